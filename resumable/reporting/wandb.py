"""Weights & Biases: the records of ``metrics.jsonl`` in ONE W&B run across every session (extra ``wandb``).

The W&B run id is recorded in each checkpoint's manifest (``wandb_run_id``, next to the config; not a
computation field, so it never blocks a resume), and every session that resumes a checkpoint continues that
run with ``wandb.init(id=..., resume="allow")``. Each record is logged at its ``step``.

W&B cannot rewind a run's history, and what it holds after a kill is not what was handed to ``wandb.log``:
wandb-core buffers records (offline: in its transaction log, written in 32 KiB blocks and every 15 s) and a
SIGKILL loses the buffer. So the last step W&B has is read back from W&B itself at the start of each session,
never from a marker of ours (which would claim steps W&B lost): online, the server's ``starting_step`` of the
resumed run; offline, the highest step in the run's earlier offline files (reporting/wandb_files.py). Then:
records with a step up to that one are not sent again (said once), and the records between it and the
resumed checkpoint — durable in ``metrics.jsonl``, which is fsynced before each checkpoint commits — are sent
from that file, so W&B ends with the same records as ``metrics.jsonl``. ``wandb.init(resume_from=...)``
(rewind) is not used: offline it only records a branch point that the server may or may not honour at sync.

A W&B failure (no network, a dead service) is raised as OSError, which the Reporters fan-out turns into one
warning; training and checkpoints go on.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import string
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import log
from ..errors import ResumableError
from .metrics import read_records
from .reporters import Reporter
from .wandb_files import last_offline_step

WANDB_ID = "wandb_run_id"  # the manifest key
INSTALL = "pip install 'resumable[wandb]' (or pip install wandb)"
_ID = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_NOT_SENT = frozenset({"step"})  # the step is W&B's own _step


def require_wandb() -> None:
    """Fail at once (exit 2 from the CLI) when W&B is asked for and not installed."""
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise ResumableError(f"W&B tracking (--wandb / tracker='wandb') needs the wandb package: {INSTALL}") from e


def stored_id(manifest: Mapping[str, Any] | None) -> str | None:
    """The W&B run id a checkpoint's manifest recorded, or None (absent, or not a plausible id)."""
    value = (manifest or {}).get(WANDB_ID)
    if value is None:
        return None
    if isinstance(value, str) and _ID.fullmatch(value):
        return value
    log.warning(f"the checkpoint's {WANDB_ID} {str(value)[:80]!r} is not a W&B run id; a new W&B run is started")
    return None


def choose_id(manifest: Mapping[str, Any] | None, tracker: Any) -> str | None:
    """The W&B run id this session records: the checkpoint's (a new one for a new run); a W&B run object's own
    id; the checkpoint's when tracking is off this session, so a later session continues the same run."""
    stored = stored_id(manifest)
    if tracker is None or tracker == "wandb":
        if tracker is None or stored is not None:
            return stored
        return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    given = str(tracker.id)
    if stored is not None and stored != given:
        log.warning(f"the W&B run passed in ({given}) is not the one the checkpoint recorded ({stored}); its history "
                    f"continues in {given}. To continue {stored}: wandb.init(id={stored!r}, resume='allow')")
    return given


@contextlib.contextmanager
def _guard(what: str) -> Iterator[None]:
    """Any W&B failure as an OSError: the Reporters fan-out warns once and training goes on."""
    try:
        yield
    except (ResumableError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - wandb raises its own errors (CommError, UsageError...) and more
        raise OSError(f"W&B {what} failed: {type(e).__name__}: {e}") from e


class WandbReporter(Reporter):
    """Logs every training and evaluation record to W&B run ``run_id`` (see the module docstring).

    ``run``: a W&B run the user started (it is logged to and not finished here); None: ``wandb.init`` with
    ``project`` (None: W&B's default, e.g. ``WANDB_PROJECT``), files under ``WANDB_DIR`` or else ``run_dir``."""

    def __init__(self, run_id: str, project: str | None, run_dir: Path, metrics: Path,
                 config: Mapping[str, Any] | None = None, run: Any = None) -> None:
        self.run_id, self.project, self.run_dir, self.metrics = run_id, project, Path(run_dir), Path(metrics)
        self.config = dict(config or {})
        self._given = run
        self._run: Any = None
        self.held: int | None = None  # the last step W&B already has; records up to it are not sent

    def session_start(self, step: int, total_steps: int | None, resumed_from: int | None) -> None:
        with _guard("init"):
            if self._given is not None:
                self._run = self._given
            else:
                import wandb

                self._run = wandb.init(project=self.project, id=self.run_id, resume="allow",
                                       dir=os.environ.get("WANDB_DIR") or str(self.run_dir), config=self.config)
            self.held = self._held()
        if self.held is not None:
            log.info(f"W&B already has steps up to {self.held}; records up to {self.held} are not sent again")
        # The records between what W&B has and the resumed checkpoint (a killed session's buffer) come from
        # metrics.jsonl, which holds them durably; nothing is logged beyond `step` yet.
        for record in read_records(self.metrics):
            if record["step"] <= step:
                self._send(record)

    def _held(self) -> int | None:
        settings = self._run.settings
        mode = getattr(settings, "mode", "online")
        if mode == "disabled":
            return None
        if mode in ("offline", "dryrun"):
            return last_offline_step(Path(settings.wandb_dir), self._run.id, exclude=Path(settings.sync_dir))
        starting = getattr(self._run, "starting_step", 0) or 0  # the server's last step + 1 on a resumed run
        return starting - 1 if starting > 0 else None

    def _send(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if self._run is None or not isinstance(step, int) or (self.held is not None and step <= self.held):
            return
        row = {k: v for k, v in record.items() if k not in _NOT_SENT and isinstance(v, (int, float))
               and not isinstance(v, bool)}
        with _guard("log"):
            self._run.log(row, step=step)  # two records of one step (train, eval) become one W&B row

    def step(self, step: int, record: dict[str, Any] | None, postfix: dict[str, str] | None) -> None:
        if record is not None:
            self._send(record)

    def epoch_end(self, record: dict[str, Any], summary: str) -> None:
        self._send(record)

    def session_end(self, step: int, ended: str) -> None:
        run, self._run = self._run, None
        if run is not None and self._given is None:
            with _guard("finish"):
                run.finish()  # makes this session's records durable (offline: the whole transaction log)
