"""The run's history of sessions: one per start of training, with how it ended.

``RUN_DIR/sessions.jsonl`` is append-only (never rolled back, unlike metrics): a ``start`` record when a
session begins training and an ``end`` record when it stops. A start without an end is a session that was
killed (or is still running). Records::

    {"event": "start", "session": 3, "time": 1764672000.0, "step": 1200, "resumed_from": 1200,
     "host": "colab-vm", "pid": 4242}
    {"event": "end", "session": 3, "time": 1764675600.0, "step": 2400, "ended": "finished"}

``ended`` is ``finished``, ``time limit``, ``save error``, ``interrupted`` or a signal name (``SIGTERM``).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .metrics import read_records

SESSIONS = "sessions.jsonl"


@dataclass
class SessionRecord:
    session: int
    start: float  # unix time
    start_step: int
    resumed_from: int | None  # the checkpoint step it resumed from; None for a fresh start
    host: str | None = None
    pid: int | None = None
    end: float | None = None
    end_step: int | None = None
    ended: str | None = None  # None: killed, or still running

    @property
    def how(self) -> str:
        return self.ended or "killed (or running)"

    @property
    def steps(self) -> int | None:
        return None if self.end_step is None else self.end_step - self.start_step

    def to_json(self) -> dict:
        return {**asdict(self), "how": self.how, "steps": self.steps}


def read_sessions(run_dir: Path) -> list[SessionRecord]:
    """The sessions of ``run_dir``, oldest first (a torn last line from a kill is ignored)."""
    sessions: dict[int, SessionRecord] = {}
    for record in read_records(Path(run_dir) / SESSIONS):
        number = record.get("session")
        if not isinstance(number, int):
            continue
        if record.get("event") == "start":
            sessions[number] = SessionRecord(number, record.get("time", 0.0), record.get("step", 0),
                                             record.get("resumed_from"), record.get("host"), record.get("pid"))
        elif record.get("event") == "end" and number in sessions:
            entry = sessions[number]
            entry.end, entry.end_step, entry.ended = record.get("time"), record.get("step"), record.get("ended")
    return [sessions[n] for n in sorted(sessions)]


class SessionLog:
    """Writes this process's start and end records."""

    def __init__(self, run_dir: Path | None) -> None:
        """``run_dir`` None: record nothing (DDP ranks other than 0)."""
        self.path = Path(run_dir) / SESSIONS if run_dir is not None else None
        self.number: int | None = None

    def _append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def start(self, step: int, resumed_from: int | None) -> int | None:
        if self.path is None:
            return None
        previous = read_sessions(self.path.parent)
        self.number = (previous[-1].session + 1) if previous else 1
        self._append({"event": "start", "session": self.number, "time": time.time(), "step": step,
                      "resumed_from": resumed_from, "host": socket.gethostname(), "pid": os.getpid()})
        return self.number

    def end(self, step: int, ended: str) -> None:
        if self.number is None:
            return
        self._append({"event": "end", "session": self.number, "time": time.time(), "step": step, "ended": ended})
        self.number = None
