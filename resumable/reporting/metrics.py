"""JSONL metrics that roll back to the resumed step, so an interrupted run's file equals an
uninterrupted one's (apart from timing fields).

Reading trusts nothing (GUIDE 13): a JSONL file of a run dir may hold a line torn by a kill, bytes that are not
UTF-8 (a bad sector, a sync tool), or records of the wrong shape. :func:`scan_jsonl` reads the file in binary,
decodes each line by itself and keeps only the records that pass a check; the others are reported in ONE
warning naming the file and the lines, and the next write of that file (``MetricsLog.rollback``, or the next
session's start for ``sessions.jsonl``) rewrites it without them. A torn last line (no newline: a kill in the
middle of a write) is expected and dropped silently.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import log
from ..atomic import replace_with

METRICS = "metrics.jsonl"
# Fields that depend on wall-clock time and legitimately differ between runs.
TIMING_FIELDS = frozenset({"time", "elapsed_s", "samples_per_s"})
_SHOWN = 5  # bad lines named in the warning; the count covers the rest


@dataclass
class JsonlScan:
    """What a JSONL file held: the good records (with their raw lines), the bad lines, and whether it ended in
    a torn line. ``unreadable``: why the file could not be read at all (then nothing else is set)."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    lines: list[bytes] = field(default_factory=list)  # the raw line of each record, for a faithful rewrite
    bad: list[tuple[int, str]] = field(default_factory=list)  # (line number from 1, why)
    torn: bool = False
    unreadable: str | None = None

    @property
    def needs_repair(self) -> bool:
        return self.unreadable is None and (bool(self.bad) or self.torn)

    def warn(self, repaired_when: str) -> None:
        """The one warning about this file (nothing when it was clean)."""
        if self.unreadable is not None:
            log.warning(f"{self.path} {self.unreadable}; its records are ignored")
        elif self.bad:
            shown = "; ".join(f"line {number}: {why}" for number, why in self.bad[:_SHOWN])
            more = f"; and {len(self.bad) - _SHOWN} more" if len(self.bad) > _SHOWN else ""
            log.warning(f"{self.path}: skipped {len(self.bad)} unreadable line(s) ({shown}{more}); "
                        f"the file is rewritten without them {repaired_when}")


def scan_jsonl(path: Path, check: Callable[[Any], str | None]) -> JsonlScan:
    """Read ``path`` line by line; ``check(record)`` returns None for a good record, else why it is bad.
    Never raises: a missing file is empty, one that is not a regular file or cannot be read is ``unreadable``."""
    scan = JsonlScan(Path(path))
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return scan
    except OSError as e:
        scan.unreadable = f"cannot be read ({e})"
        return scan
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
        scan.unreadable = f"is {kind}, not a regular file (move it away so that a new one can be written)"
        return scan
    try:
        # O_NONBLOCK/O_NOFOLLOW: a FIFO or a link swapped in after the lstat is refused instead of hanging.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                scan.unreadable = "is not a regular file"
                return scan
            data = handle.read()
    except OSError as e:
        scan.unreadable = f"cannot be read ({e})"
        return scan
    lines = data.split(b"\n")
    last = len(lines) - 1  # the piece after the final newline: b"" for a complete file, else a torn line
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            scan.bad.append((number, f"not UTF-8 (byte {e.start})"))
            continue
        try:
            record = json.loads(text)
        except (ValueError, RecursionError):
            if number - 1 == last:
                scan.torn = True  # a kill in the middle of a write: expected, not worth a warning
            else:
                scan.bad.append((number, "not JSON"))
            continue
        problem = check(record)
        if problem is not None:
            scan.bad.append((number, problem))
            continue
        scan.records.append(record)
        scan.lines.append(raw)
    return scan


def rewrite_jsonl(path: Path, lines: list[bytes]) -> None:
    """Replace ``path`` with ``lines`` atomically (temp file, fsync, rename, fsync of the folder): a kill at
    any instant leaves the old file or the new one."""
    replace_with(Path(path), b"".join(line + b"\n" for line in lines))


def metric_problem(record: Any) -> str | None:
    """Why ``record`` is not a metrics record (a JSON object with an integer ``step`` >= 0), or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not a record"
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"'step' is {json.dumps(step)[:30]}, not an integer >= 0"
    return None


def read_records(path: Path) -> list[dict[str, Any]]:
    """The good records of a metrics file (see the module docstring for what is skipped, and the warning)."""
    scan = scan_jsonl(path, metric_problem)
    scan.warn("when training resumes")
    return scan.records


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
        """Keep only records with ``step <= step`` (and drop unreadable lines); returns how many records
        were dropped."""
        if self.path is None:
            return 0
        scan = scan_jsonl(self.path, metric_problem)
        scan.warn("now")
        if scan.unreadable is not None:
            return 0  # not a file we may replace (a directory, a link): leave it as it is
        kept = [raw for record, raw in zip(scan.records, scan.lines, strict=True) if record["step"] <= step]
        dropped = len(scan.records) - len(kept)
        if dropped or scan.needs_repair:
            rewrite_jsonl(self.path, kept)
        return dropped

    def log(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._handle is None:  # the run dir exists (its lock is there): never recreated here
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
