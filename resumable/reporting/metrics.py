"""JSONL metrics that roll back to the resumed step, so an interrupted run's file equals an
uninterrupted one's (apart from timing fields)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
# Fields that depend on wall-clock time and legitimately differ between runs.
TIMING_FIELDS = frozenset({"time", "elapsed_s", "samples_per_s"})


def read_records(path: Path) -> list[dict[str, Any]]:
    """Complete JSON records of a metrics file; a torn last line from a kill is ignored."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def without_timing(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]


class MetricsLog:
    """Append-only JSONL log of training and evaluation records, each carrying ``step``."""

    def __init__(self, path: Path | None) -> None:
        """``path`` None: a log that records nothing (DDP ranks other than 0)."""
        self.path = Path(path) if path is not None else None
        self._handle = None
        self.on_record: Callable[[dict[str, Any]], None] | None = None  # e.g. TensorBoard

    def rollback(self, step: int) -> int:
        """Keep only records with ``step <= step``; returns how many were dropped."""
        if self.path is None:
            return 0
        records = read_records(self.path)
        kept = [r for r in records if isinstance(r.get("step"), int) and r["step"] <= step]
        dropped = len(records) - len(kept)
        if self.path.exists():
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
            os.replace(tmp, self.path)
        return dropped

    def log(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Line-buffered: each record reaches the OS at once, so a kill loses none that were logged
            # and progress is visible to anyone reading the file.
            self._handle = open(self.path, "a", encoding="utf-8", buffering=1)
        self._handle.write(json.dumps(record) + "\n")
        if self.on_record is not None:
            self.on_record(record)

    def sync(self) -> None:
        """Make every record so far durable (fsync); called before a checkpoint commits, possibly from
        the checkpoint writer's thread."""
        handle = self._handle
        if handle is not None:
            os.fsync(handle.fileno())

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
