"""Lightning ``Trainer`` runs that survive being killed: a callback and a ``CheckpointIO``, and four lines in a script.

>>> resumable = ResumableCallback("runs/x/checkpoints", every_n_steps=50, time_limit="2h")  # doctest: +SKIP
>>> trainer = L.Trainer(max_steps=1000, callbacks=[resumable], plugins=[resumable.checkpoint_io])  # doctest: +SKIP
>>> trainer.fit(model, loader, ckpt_path=resumable.latest_valid())  # doctest: +SKIP
>>> sys.exit(resumable.exit_code)  # 75: stopped early with the state committed, run again  # doctest: +SKIP

What it adds to Lightning:

* **Commit.** Every ``every_n_steps`` (and at the last step, and at a stop) the callback saves
  ``DIRPATH/step-N/lightning.ckpt`` through ``trainer.save_checkpoint``; its CheckpointIO (lightning_io.py) commits the
  folder with resumable's manifest, written last. Only then are older folders pruned (``keep``).
* **Newest valid resume.** :meth:`ResumableCallback.latest_valid` is the ``ckpt_path``: the newest committed folder
  whose file verifies, newer ones skipped with the reason (Drive's newest brought back first with ``drive=``).
* **What Lightning's checkpoint lacks.** The RNG streams (Python, NumPy, torch CPU and CUDA) go into the callback's
  state in the checkpoint and are put back where the uninterrupted run stood; the per-step metrics
  (``DIRPATH/metrics.jsonl``, what the step logged) are rolled back to the resumed step, so each step is there once.
* **Stops in time.** SIGTERM, SIGINT, SIGUSR1, SIGHUP and the session budget (``time_limit``; Colab's VM lifetime or
  Kaggle's session limit by default there; at most what ``resumable run --time-limit`` leaves) save, commit and stop
  the Trainer at the next step boundary; :attr:`exit_code` is then 75.
* **Drive.** ``drive=`` mirrors committed folders with the same Mirror as ``resumable-train`` and the HF Trainer
  (hf_drive.DriveLink on ``step-N`` folders).

Mid-epoch resume is exact with a torchdata ``StatefulDataLoader`` (Lightning saves and restores its position) and
from a checkpoint at an epoch's end; docs/lightning.md says what a plain ``DataLoader`` resumed mid-epoch gives.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Checkpoint

from .. import log
from ..checkpoint import CheckpointManager
from ..checkpoint.layout import STEPS
from ..config import seconds_of
from ..engine.loop.preemption import Budget, StopFlag, integration_limit_s
from ..engine.state.train_state import capture_rng, restore_rng
from ..errors import EXIT_NOT_DURABLE, EXIT_RESUME
from ..faults import Faults, installed
from ..reporting.metrics import MetricsLog
from ..storage.base import run_of
from . import lightning_io as lio
from .hf_drive import DriveLink

__all__ = ["CommitCheckpointIO", "ResumableCallback", "latest_valid"]

CommitCheckpointIO = lio.CommitCheckpointIO
latest_valid = lio.latest_valid


class ResumableCallback(Checkpoint):
    """Saves, commits, prunes, stops in time and mirrors a Lightning run (see the module docstring).

    ``dirpath``: the folder of the ``step-N`` checkpoints (the callback's own). ``every_n_steps``: save every N
    optimizer steps (None: only at the last step and at a stop). ``keep``: committed checkpoints kept.
    ``time_limit``: seconds or a duration ("90m") from the callback's creation. ``drive``: ``gdrive://...`` or a
    mounted Drive folder. ``metrics``: the per-step metrics file in ``dirpath`` (None: none).

    Being a ``Checkpoint``, it runs after the other callbacks at each step end, and the Trainer adds no
    ``ModelCheckpoint`` of its own. After ``fit``: :attr:`stopped_early` (the reason, or None) and :attr:`exit_code`
    (0; 75 stopped early with its checkpoint committed; 74 the newest checkpoint is not yet durable on Drive).
    """

    def __init__(self, dirpath: str | os.PathLike[str], every_n_steps: int | None = None, keep: int = 2,
                 time_limit: str | float | None = None, drive: str | None = None, *,
                 metrics: str | None = "metrics.jsonl", flush_timeout: str | float = "10m",
                 cache_dir: str | None = None, credentials: str | None = None, faults: Faults | None = None) -> None:
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or every_n_steps < 1):
            raise ValueError(f"every_n_steps={every_n_steps!r} must be a positive number of steps, or None")
        if isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep={keep!r} must be at least 1 (the checkpoint resumed from is always kept)")
        self.dirpath = Path(dirpath)
        self.every_n_steps, self.keep = every_n_steps, keep
        limit = seconds_of(time_limit, "time_limit")
        self.budget = Budget(integration_limit_s(limit))
        self.faults = faults or installed()
        self.checkpoint_io = CommitCheckpointIO(self.dirpath, faults=self.faults)
        self.metrics = MetricsLog(self.dirpath / metrics) if metrics else None
        self.drive, self.flush_timeout_s = drive, seconds_of(flush_timeout, "flush_timeout") or 0.0
        self._drive_options = {"cache_dir": cache_dir, "credentials": credentials}
        self.stopped_early: str | None = None
        self.exit_code = 0
        self.run_id: str | None = None
        self.resumed_step: int | None = None  # the step latest_valid chose, None for a fresh start
        self._link: DriveLink | None = None
        self._stop: StopFlag | None = None
        self._rng: dict[str, Any] | None = None  # put back at the first batch after a mid-epoch resume
        self._step_at, self._step_s, self._save_s = 0.0, 0.0, None
        self._saved_at: int | None = None

    # -- before fit -----------------------------------------------------------------------------------------
    def _drive_link(self) -> DriveLink | None:
        if self.drive is not None and self._link is None:
            steps = CheckpointManager(Path(self.dirpath), layout=STEPS)
            self._link = DriveLink(self.dirpath, self.drive, checkpoints=steps, **self._drive_options)
        return self._link

    def latest_valid(self) -> str | None:
        """The ``ckpt_path`` for ``trainer.fit``: :func:`latest_valid` of ``dirpath``, after bringing Drive's newest
        durable checkpoint back when ``drive`` is set; None for a fresh start."""
        link = self._drive_link()
        if link is not None:
            link.restore()
        chosen = latest_valid(self.dirpath)
        self.resumed_step = None
        if chosen is not None:
            self.resumed_step = STEPS.parse(Path(chosen).parent.name)
            store = self.checkpoint_io.store
            self.run_id = run_of(store.check(self.resumed_step, Path(chosen).parent, deep=False).manifest)
        return chosen

    # -- the checkpoint's extra state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"rng": capture_rng(), "run_id": self.run_id, "mid_epoch": self._mid_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Put back now, before the Trainer makes the epoch's iterator (a shuffled DataLoader draws its order from
        # torch's RNG there: exact from a checkpoint at an epoch's end)...
        restore_rng(state_dict["rng"])
        # ... and again at the first batch when the checkpoint is mid-epoch: between two batches the uninterrupted
        # run drew nothing, while this one made an iterator since.
        self._rng = state_dict["rng"] if state_dict.get("mid_epoch", True) else None
        self.run_id = self.run_id or state_dict.get("run_id")

    # -- Callback hooks --------------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and trainer.strategy.checkpoint_io is not self.checkpoint_io:
            # Trainer(plugins=[callback.checkpoint_io]) not given: the callback's saves must still be committed
            self.checkpoint_io.wrapped = trainer.strategy.checkpoint_io
            trainer.strategy.checkpoint_io = self.checkpoint_io

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.run_id = self.run_id or uuid.uuid4().hex
        self.dirpath.mkdir(parents=True, exist_ok=True)
        self.checkpoint_io.meta = {"run_id": self.run_id}
        if self.metrics is not None and trainer.is_global_zero:
            self.metrics.rollback(self.resumed_step or 0)  # what a killed session logged after its last commit
        link = self._drive_link() if trainer.is_global_zero else None
        if link is not None and link.mirror is None:
            link.start(self.run_id)
            self.budget.durable_s = lambda n: link.mirror.pace.durable_s(n) if link.mirror is not None else 0.0
        self._close_stop()
        # After Lightning's own SIGTERM handler (registered before this hook): the stop is this callback's
        self._stop = StopFlag().__enter__()
        self.stopped_early, self.exit_code, self._saved_at = None, 0, None
        self._step_at = time.monotonic()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._rng is not None:
            restore_rng(self._rng)
            self._rng = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.monotonic()
        self._step_s, self._step_at = now - self._step_at, now
        step = trainer.global_step
        if self.metrics is not None and trainer.is_global_zero:
            self.metrics.log({"step": step, **_scalars(trainer.callback_metrics)})
        self.faults.after_step(step)
        last = _is_last_step(trainer)
        due = self.every_n_steps is not None and step % self.every_n_steps == 0
        reason = None
        if not last:
            if self._stop is not None and self._stop.requested:
                reason = f"signal {self._stop.requested}"
            elif not self.budget.fits(self._step_s, self._save_s if self._save_s is not None else self._step_s,
                                      saves=2 if due else 1):
                reason = "the session's time budget is spent"
        if reason is not None or due or last:
            self._save(trainer, step, mid_epoch=not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        if reason is not None:
            self.stopped_early, self.exit_code = reason, EXIT_RESUME
            trainer.should_stop = True
            log.info(f"stopped early ({reason}): {STEPS.name(step)} committed. Run the same script again to "
                     f"continue (exit code {EXIT_RESUME})")
        self._step_at = time.monotonic()  # the save is not part of the next step's time

    def _save(self, trainer: Any, step: int, mid_epoch: bool) -> None:
        if self._saved_at == step:
            return
        began = time.monotonic()
        if self.metrics is not None:
            self.metrics.sync()  # the records up to this step are on disk before the checkpoint vouches for them
        self._mid_epoch = mid_epoch
        # weights_only=False here is Lightning's "the whole training state, not only the weights"; the file is loaded
        # back with torch.load(weights_only=True) (lightning_io.CommitCheckpointIO.load_checkpoint)
        trainer.save_checkpoint(lio.checkpoint_file(self.dirpath, step), weights_only=False)
        self._saved_at, self._save_s = step, time.monotonic() - began
        if trainer.is_global_zero:
            self._prune()
            if self._link is not None:
                self._link.committed(step)

    def _prune(self) -> None:
        """``keep`` applied after a commit; the checkpoint being uploaded stays."""
        uploading = self._link.mirror.protected() if self._link is not None and self._link.mirror else set()
        self.checkpoint_io.store.prune(self.keep, False, set(uploading))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close_stop()
        if self.metrics is not None:
            self.metrics.close()
        if self._link is not None and self._link.mirror is not None:
            self._link.mirror.flush(self.flush_timeout_s)
            self._prune()
            if self._link.close(self.flush_timeout_s):
                self.exit_code = EXIT_NOT_DURABLE
            self._link = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close_stop()
        if self.metrics is not None:
            self.metrics.close()

    def _close_stop(self) -> None:
        if self._stop is not None:
            self._stop.__exit__(None, None, None)
            self._stop = None

    _mid_epoch = True


def _is_last_step(trainer: Any) -> bool:
    """Whether this step ends the fit: ``max_steps`` reached, or the last batch of the last epoch."""
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
        return True
    epochs = trainer.max_epochs
    return (epochs is not None and epochs >= 0 and trainer.current_epoch >= epochs - 1
            and bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch))


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The scalar metrics of this step, as JSON numbers (NaN and infinities as strings JSON can hold)."""
    found = {}
    for name, value in sorted(metrics.items()):
        try:
            number = float(value.item() if hasattr(value, "item") else value)
        except (TypeError, ValueError, RuntimeError):
            continue
        found[name] = number if math.isfinite(number) else repr(number)
    return found
