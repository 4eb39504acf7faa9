"""The run's history of sessions: one per start of training, with how it ended.

``RUN_DIR/sessions.jsonl`` is append-only (never rolled back, unlike metrics): a ``start`` record when a
session begins training and an ``end`` record when it stops. A start without an end is a session that was
killed (or is still running). Records::

    {"event": "start", "session": 3, "time": 1764672000.0, "step": 1200, "resumed_from": 1200,
     "host": "colab-vm", "pid": 4242, "device": "cuda (Tesla T4, sm_75)",
     "amp_switch": {"from": "bf16", "to": "fp16", "why": "..."}, "code": "5d41402abc4b2a76",
     "config": "7d793037a0760186"}
    {"event": "end", "session": 3, "time": 1764675600.0, "step": 2400, "ended": "finished"}
    {"event": "end", "session": 4, "time": 1764679200.0, "step": 2410, "ended": "error: RuntimeError",
     "error": "RuntimeError: CUDA error: an illegal memory access was encountered"}

``ended`` is ``finished``, ``time limit``, ``save error``, ``save stuck``, ``interrupted``, a signal name
(``SIGTERM``, ``SIGTERM (at once)`` for a second one during a save), ``hang`` (the step watchdog fired:
engine/loop/watchdog.py), ``break`` (the loop was left early: a ``break``, or an exception that the caller caught around
the loop), ``closed`` or ``error: TYPE`` (an exception); ``error`` says what failed (for an exception, its type and
message), which the crash-loop check (engine/rundir/crash_loop.py) quotes. A session may have a second end record: a
loop left by an exception first records ``break`` (the generator cannot see the exception) and then the exception, once
the script or notebook cell reports it (engine/session/open_runs.py); the last end record of a session counts. ``code``
and ``config`` are digests of the code that built and iterated the Run and of its options (engine/session/identity.py):
a crash loop needs them unchanged. ``device`` is where the session trained (engine/state/hardware.py); ``amp_switch`` is
present only when ``--amp auto`` changed the checkpoint's AMP dtype at this start (bf16 on a GPU without native bf16).
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .metrics import JsonlScan, rewrite_jsonl, scan_jsonl

SESSIONS = "sessions.jsonl"
ERROR_MAX = 500  # characters of an error kept in an end record


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
    error: str | None = None  # what failed, when an exception or a hang ended it
    device: str | None = None  # where it trained, e.g. "cuda (Tesla T4, sm_75)" (absent in older records)
    amp_switch: dict | None = None  # the bf16 -> fp16 switch of --amp auto at this start, if any
    code: str | None = None  # digest of the script or notebook cells that ran it (absent in older records)
    config: str | None = None  # digest of its options

    @property
    def how(self) -> str:
        return self.ended or "killed (or running)"

    @property
    def steps(self) -> int | None:
        return None if self.end_step is None else self.end_step - self.start_step

    def to_json(self) -> dict:
        return {**asdict(self), "how": self.how, "steps": self.steps}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _optional(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or ok(value)


def _text(value: Any) -> bool:
    return isinstance(value, str)


# Fields of the records read_sessions uses: name -> (check, required). Other fields and other events are kept
# as they are (a newer resumable may add some).
_START = {"time": (_number, True), "step": (_count, True), "resumed_from": (_optional(_count), False),
          "host": (_optional(_text), False), "pid": (_optional(_count), False),
          "device": (_optional(_text), False), "amp_switch": (_optional(lambda v: isinstance(v, dict)), False),
          "code": (_optional(_text), False), "config": (_optional(_text), False)}
_END = {"time": (_optional(_number), False), "step": (_optional(_count), False), "ended": (_optional(_text), False),
        "error": (_optional(_text), False)}


def session_problem(record: Any) -> str | None:
    """Why ``record`` is not a session record this reader can use, or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not a record"
    number = record.get("session")
    if not _count(number) or number < 1:
        return f"'session' is {json.dumps(number)[:30]}, not an integer >= 1"
    event = record.get("event")
    if not isinstance(event, str):
        return f"'event' is {json.dumps(event)[:30]}, not a string"
    for name, (ok, required) in {"start": _START, "end": _END}.get(event, {}).items():
        if name not in record:
            if required:
                return f"{event} record lacks {name!r}"
        elif not ok(record[name]):
            return f"{event} record field {name!r} is {json.dumps(record[name])[:30]}"
    return None


def _scan(run_dir: Path) -> JsonlScan:
    return scan_jsonl(Path(run_dir) / SESSIONS, session_problem)


def _sessions(records: list[dict[str, Any]]) -> list[SessionRecord]:
    sessions: dict[int, SessionRecord] = {}
    for record in records:
        number = record["session"]
        if record["event"] == "start":
            sessions[number] = SessionRecord(number, float(record["time"]), record["step"],
                                             record.get("resumed_from"), record.get("host"), record.get("pid"),
                                             device=record.get("device"), amp_switch=record.get("amp_switch"),
                                             code=record.get("code"), config=record.get("config"))
        elif record["event"] == "end" and number in sessions:
            entry = sessions[number]
            entry.end, entry.end_step, entry.ended = record.get("time"), record.get("step"), record.get("ended")
            entry.error = record.get("error")
    return [sessions[n] for n in sorted(sessions)]


def read_sessions(run_dir: Path, warn: bool = True) -> list[SessionRecord]:
    """The sessions of ``run_dir``, oldest first. A torn last line from a kill is ignored; an undecodable or
    wrong-typed line is skipped with one warning (the next session's start rewrites the file without it), unless
    ``warn`` is False: a reader right before that start, which warns itself."""
    scan = _scan(run_dir)
    if warn:
        scan.warn("when the next training session starts")
    return _sessions(scan.records)


class SessionLog:
    """Writes this process's start and end records."""

    def __init__(self, run_dir: Path | None) -> None:
        """``run_dir`` None: record nothing (DDP ranks other than 0)."""
        self.path = Path(run_dir) / SESSIONS if run_dir is not None else None
        self.number: int | None = None
        self.error: str | None = None  # what failed, recorded with the end (see :meth:`note_error`)
        self.last_end: tuple[int, str] | None = None  # (session, ended) of the end record this log wrote
        self._ending = threading.Lock()

    def _append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:  # the run dir exists: it is never recreated here
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def start(self, step: int, resumed_from: int | None, note: str | None = None,
              extra: dict[str, Any] | None = None) -> int | None:
        """Record the session's start; ``note`` says what changed since the last one (e.g. the dataset), ``extra``
        adds fields (``device``, ``amp_switch``)."""
        if self.path is None:
            return None
        scan = _scan(self.path.parent)
        scan.warn("now")
        if scan.needs_repair:  # under the run dir's lock: no other writer; appending after a torn line would
            rewrite_jsonl(self.path, scan.lines)  # glue this start record to it, and both would be lost
        previous = _sessions(scan.records)
        self.number = (previous[-1].session + 1) if previous else 1
        record = {**(extra or {}), "event": "start", "session": self.number, "time": time.time(), "step": step,
                  "resumed_from": resumed_from, "host": socket.gethostname(), "pid": os.getpid()}
        self._append({**record, "note": note} if note else record)
        return self.number

    def note_error(self, error: str) -> None:
        """What ended the session (an exception's type and message), written with its end record."""
        self.error = error[:ERROR_MAX]

    def end(self, step: int, ended: str, error: str | None = None) -> None:
        """Record the end; called once, by the training thread or by the watchdog of a hung one
        (engine/loop/watchdog.py)."""
        with self._ending:  # the first caller writes it
            number, self.number = self.number, None
        if number is None:
            return
        self.last_end = (number, ended)
        record = {"event": "end", "session": number, "time": time.time(), "step": step, "ended": ended}
        error = error or self.error
        self._append({**record, "error": error[:ERROR_MAX]} if error else record)

    def amend(self, step: int, was: str, ended: str, error: str | None) -> bool:
        """Write a second end record for the session this log ended as ``was`` (the reader keeps the last): a loop
        left by an exception ends as ``break`` before the exception is known. False when that session ended
        otherwise (a hang recorded by the watchdog stays a hang)."""
        if self.path is None or self.last_end is None or self.last_end[1] != was:
            return False
        number, _ = self.last_end
        self.last_end = (number, ended)
        record = {"event": "end", "session": number, "time": time.time(), "step": step, "ended": ended}
        self._append({**record, "error": error[:ERROR_MAX]} if error else record)
        return True
