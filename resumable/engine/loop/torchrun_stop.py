"""Stops planned under ``torchrun`` (torchelastic), which counts every non-zero worker exit as a crash.

A worker that exits 75 makes the elastic agent restart the whole group under ``--max-restarts``: it trains on
with a fresh budget and at last exits 1. So a worker that stops on purpose there (a signal, the time limit: not
a failed save) records a :class:`PlannedStop` in ``RUN_DIR/stopped.json`` and exits 0, which ends the group.
``resumable torchrun`` (tools/launch.py) reads the marker after the group ends and exits 75; a group restarted
after a real crash finds the marker of its own torchelastic run and exits 0 at once instead of training on.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ... import log
from ...atomic import write_json_atomic
from ...distributed import Distributed
from ...errors import EXIT_RESUME

STOPPED = "stopped.json"  # in the run dir: the planned stop of the newest session under torchelastic
STOP_MARKER_ENV = "RESUMABLE_STOP_MARKER"  # set by `resumable torchrun`: where each node's launcher looks
_MARKER_MAX_BYTES = 64 * 1024


def elastic_run_id() -> str | None:
    """The torchelastic run id when this process is a ``torchrun`` worker (None otherwise)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


@dataclass(frozen=True)
class PlannedStop:
    """A stop on purpose (a signal, the time limit, a failed save, a lost lock) with its state committed."""

    run_id: str  # the torchelastic run id of the job that stopped
    reason: str
    step: int
    time: float

    @classmethod
    def from_json(cls, data: Any) -> PlannedStop | None:
        """The marker in ``data``, or None when it is not a valid one."""
        if not isinstance(data, dict):
            return None
        run_id, reason, step, when = (data.get(k) for k in ("torchelastic_run_id", "reason", "step", "time"))
        if not (isinstance(run_id, str) and run_id and isinstance(reason, str) and isinstance(step, int)
                and not isinstance(step, bool) and step >= 0 and isinstance(when, (int, float))):
            return None
        return cls(run_id, reason, step, float(when))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        return {"torchelastic_run_id": data.pop("run_id"), **data}


def read_planned_stop(path: Path) -> PlannedStop | None:
    """The marker at ``path``; None when there is none or it is not a regular file holding a valid one."""
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MARKER_MAX_BYTES:
            return None
        return PlannedStop.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def write_planned_stop(path: Path, stop: PlannedStop) -> None:
    """Write the marker atomically (temp file, fsync, rename): a reader sees none or all of it."""
    write_json_atomic(Path(path), stop.to_json())


def planned(reason: str) -> bool:
    """Whether an early stop was asked for (a signal, the time limit) rather than forced by a failure (a save
    that failed, the run dir's lock lost to another process): those stay exit 75 under torchrun too, which
    counts them as failures, so that a failure never looks like success."""
    return reason not in ("save error", "lock lost", "checkpoint missing")


def record_planned_stop(dist: Distributed, run_dir: Path, reason: str, step: int) -> bool:
    """After a stop on purpose under torchelastic (every rank calls it): rank 0 writes ``RUN_DIR/stopped.json``
    and each node's local rank 0 the file ``resumable torchrun`` watches. True on every rank when recorded:
    the workers then exit 0 so that the elastic agent does not restart them; False (not under torchelastic,
    not :func:`planned`, or a write failed on some rank) keeps exit 75."""
    run_id = elastic_run_id()
    if run_id is None or not planned(reason):
        return False
    stop = PlannedStop(run_id, reason, step, time.time())
    error: str | None = None
    try:
        if dist.main:
            write_planned_stop(Path(run_dir) / STOPPED, stop)
        launcher = os.environ.get(STOP_MARKER_ENV)
        if launcher and os.environ.get("LOCAL_RANK", "0") == "0":
            write_planned_stop(Path(launcher), stop)
    except OSError as e:
        error = str(e)
    failed = dist.all_errors(error)
    if failed:
        rank, message = failed[0]
        log.warning(f"rank {rank} could not record the planned stop ({message}); exiting {EXIT_RESUME}, so torchrun "
                    f"counts it as a failure (a restarted group resumes from the committed checkpoint)")
        return False
    return True


def planned_stop_before_restart(dist: Distributed, run_dir: Path) -> PlannedStop | None:
    """At the start of a session (every rank calls it, after the run dir is locked): in a group that
    torchelastic restarted after a failure, the stop this same job made on purpose before, if any; the
    session then exits 0 at once instead of training past the user's stop. Otherwise rank 0 removes an older
    marker, so that ``stopped.json`` only ever describes the newest session."""
    found: PlannedStop | None = None
    if dist.main:
        path = Path(run_dir) / STOPPED
        stop = read_planned_stop(path)
        run_id = elastic_run_id()
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
        if stop is not None and run_id is not None and restarted and stop.run_id == run_id:
            found = stop
        else:
            try:
                path.unlink(missing_ok=True)  # a link is removed itself, never followed
            except OSError as e:
                log.warning(f"cannot remove the old planned-stop marker {path} ({e})")
    return dist.broadcast(found)
