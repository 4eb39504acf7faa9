"""What every experiment tracker reporter shares (W&B, MLflow, trackio): ONE tracker run across sessions, whose id
is recorded in each checkpoint's manifest, and each step in the tracker once.

Shared here: the check that the tracker's package is installed (exit 2 naming the pip command), the run id read
back from a manifest (a plausible name or nothing, never trusted blindly), a tracker failure turned into the
OSError that the Reporters fan-out warns about once, the row of a record (its numbers, the step aside), and
how rows are compared (timing fields aside, NaN equal to NaN).

:class:`StoreReporter` is the reporter of trackers whose store can delete what a killed session logged after
the resumed step (MLflow's file store, trackio's SQLite): at each session start the store drops every step after
the resumed one, the steps up to it that the store lacks (lost in a killed session's buffer) are sent from
``metrics.jsonl`` (fsynced before each checkpoint commits), and from then on each step's records are sent as ONE
row once the step is complete. A store that cannot delete (a tracking server) keeps what it has: those steps are
not sent again, and a re-trained value that differs is warned about once. W&B (reporting/wandb.py) cannot delete
either and has its own reading-back of what it holds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from .. import log
from ..errors import ResumableError
from .metrics import TIMING_FIELDS, read_records
from .reporters import Reporter

TRACKERS = ("wandb", "mlflow", "trackio")
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


def require(module: str, extra: str, what: str) -> None:
    """Fail at once (exit 2 from the CLI) when a tracker is asked for and its package is not installed. Found, not
    imported: trackio reads its folder from the environment when it is imported (reporting/trackio.py)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None (import blocked)
        found = False
    if not found:
        raise ResumableError(f"{what} needs the {module} package: pip install 'resumable[{extra}]' "
                             f"(or pip install {extra})")


def stored_name(manifest: Mapping[str, Any] | None, key: str, what: str) -> str | None:
    """The tracker run id or name a checkpoint's manifest recorded under ``key``, or None (absent, or not a plain
    name: a new tracker run is started and that is said)."""
    value = (manifest or {}).get(key)
    if value is None:
        return None
    if isinstance(value, str) and _NAME.fullmatch(value):
        return value
    log.warning(f"the checkpoint's {key} {str(value)[:80]!r} is not a {what} run id; a new {what} run is started")
    return None


@contextlib.contextmanager
def guard(tracker: str, what: str) -> Iterator[None]:
    """Any tracker failure as an OSError: the Reporters fan-out warns once and training goes on."""
    try:
        yield
    except (ResumableError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - trackers raise their own errors (CommError, MlflowException...) and more
        raise OSError(f"{tracker} {what} failed: {type(e).__name__}: {e}") from e


def numbers(record: Mapping[str, Any]) -> dict[str, float | int]:
    """What a tracker gets of a record: its numbers, the step aside (the tracker's own)."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def values(row: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What a tracker's row and a record must agree on: the logged values, without the tracker's own keys
    (``_step``, ``timestamp``...) and timing fields."""
    if row is None:
        return None
    return {k: v for k, v in row.items() if not k.startswith("_") and k not in ("step", "timestamp")
            and k not in TIMING_FIELDS}


def same(a: Any, b: Any) -> bool:
    """Equal values (NaN equal to NaN: a diverged loss logged in both); dicts key by key."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


class Store(Protocol):
    """One tracker run as :class:`StoreReporter` uses it."""

    name: str  # the tracker's name in messages: "MLflow", "trackio"
    key: str  # the manifest key of its run id or name
    ident: str | None  # the run's id or name (known after open() for a new MLflow run)

    def open(self) -> None:
        """Start or continue the tracker run."""

    def truncate(self, after: int) -> bool:
        """Delete every step after ``after`` from the run; False when the store cannot delete."""

    def history(self) -> dict[int, dict[str, Any]]:
        """The run's stored rows, one per step (a step's keys merged)."""

    def log(self, step: int, row: dict[str, float | int]) -> None: ...

    def close(self, ended: str) -> None:
        """End this session's use of the run (``ended``: how the session ended, "finished" at the run's end)."""


class StoreReporter(Reporter):
    """Every training and evaluation record in ``store``, each (key, step) once (see the module docstring)."""

    def __init__(self, store: Store, metrics: Path) -> None:
        self.store, self.metrics = store, Path(metrics)
        self.held: dict[int, dict[str, Any]] = {}  # what the store has, per step; nothing is sent twice
        self._pending: tuple[int, dict[str, float | int]] | None = None  # the step being completed
        self._open = False
        self._warned = False

    def session_start(self, step: int, total_steps: int | None, resumed_from: int | None) -> None:
        name = self.store.name
        with guard(name, "start"):
            self.store.open()
            self._open = True
            self.store.truncate(step)
            self.held = self.store.history()
        later = [s for s in self.held if s > step]
        if later:  # a store that cannot delete: those steps keep their values
            log.info(f"{name} already has steps up to {max(later)} and cannot delete them: the records of steps "
                     f"{step + 1} to {max(later)} are not sent again (a different value is warned about)")
        for record in read_records(self.metrics):  # what a killed session's buffer lost, durable in metrics.jsonl
            if record["step"] <= step:
                self._add(record)
        self._flush()

    def _add(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or not self._open:
            return
        if self._pending is not None and self._pending[0] != step:
            self._flush()
        if self._pending is None:
            self._pending = (step, {})
        unsent = getattr(self.store, "unsent", ())
        self._pending[1].update({k: v for k, v in numbers(record).items() if k not in unsent})

    def _flush(self) -> None:
        """Send the pending step's keys the store lacks, as one row (a step's train and eval records together)."""
        if self._pending is None:
            return
        (step, row), self._pending = self._pending, None
        stored = self.held.setdefault(step, {})
        new = {k: v for k, v in row.items() if k not in stored}
        if not self._warned:
            theirs, mine = values(stored), values(row)
            differ = sorted(k for k in theirs if k in mine and not same(theirs[k], mine[k]))
            if differ:
                self._warned = True
                log.warning(f"{self.store.name} already has step {step} with other values ({differ[0]} "
                            f"{theirs[differ[0]]} there, {mine[differ[0]]} here) and cannot delete it: it keeps the "
                            f"earlier session's values of the steps it had; metrics.jsonl has this session's")
        if new:
            with guard(self.store.name, "log"):
                self.store.log(step, new)
            stored.update(new)

    def step(self, step: int, record: dict[str, Any] | None, postfix: dict[str, str] | None) -> None:
        if record is not None:
            self._add(record)

    def summary(self, record: dict[str, Any], line: str) -> None:
        self._add(record)

    def session_end(self, step: int, ended: str) -> None:
        if not self._open:
            return
        self._open = False
        try:
            self._flush()
        finally:
            with guard(self.store.name, "finish"):
                self.store.close(ended)
