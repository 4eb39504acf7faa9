"""Accelerate's ``save_state`` / ``load_state`` made safe to kill: a wrapper an Accelerate script calls instead.

>>> ckpt = ResumableState(accelerator, "runs/mine", save_every=50, keep=2)  # doctest: +SKIP
>>> start = ckpt.load_state()  # the newest *valid* checkpoint_N, RNG restore checked; Position() on a fresh start
>>> ... accelerator.skip_first_batches(loader, start.batch) in the epoch start.epoch ...  # doctest: +SKIP
>>> if ckpt.step_end(step, epoch, batch): sys.exit(ckpt.finish())  # saved when due; True: stop, state committed

What it changes in Accelerate's own checkpoints (``accelerator.save_state`` still writes every file):

* **Commit.** Each save goes to ``RUN_DIR/checkpoints/checkpoint_<step>`` (Accelerate's naming, numbered by the
  training step). After ``save_state`` returns, every file is fsynced and hashed and resumable's ``manifest.json`` is
  written last (:meth:`CheckpointManager.adopt`), with the data position (step, epoch, batch) in it. A folder without
  a valid manifest is never resumed from: :meth:`ResumableState.load_state` skips it with the reason. Accelerate's
  ``load_state()`` takes the highest number, complete or not.
* **Retention after the commit.** ``keep`` (default: ``ProjectConfiguration.total_limit``) newest committed ones stay;
  older ones go only after the new one is committed. Accelerate's own rotation, with ``automatic_checkpoint_naming``
  and ``total_limit``, deletes the oldest folder *before* writing the new one: it is switched off during the save.
* **RNG restore checked.** Accelerate restores the Python, NumPy and torch RNG states inside a ``try`` and logs
  "Could not load random states" at INFO when that fails (accelerate#4283). After ``load_state`` the live states are
  compared with the folder's ``random_states_<rank>.pkl``; any difference raises :class:`ResumeNotApplied`.
* **Stops in time.** SIGTERM, SIGINT, SIGUSR1, SIGHUP and the session budget (``time_limit``; in Colab the VM's
  lifetime less 20 minutes) make :meth:`ResumableState.step_end` save, commit and return True; ``finish()`` is then
  75 (:data:`~resumable.errors.EXIT_RESUME`).
* **Drive.** ``drive=`` mirrors committed folders with the Trainer integration's :class:`DriveLink` (the same Mirror
  and restore as ``resumable-train``), and a fresh VM brings the newest durable one back before choosing.

Why a wrapper and not Accelerate's hooks: ``register_save_state_pre_hook`` runs *before* the files are written (there
is no post-save hook, so nothing could write the manifest after them), Accelerate's rotation runs before the hooks,
and ``load_state()`` has chosen its folder before ``register_load_state_pre_hook`` runs and restores the RNG after it.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import accelerate
import numpy as np
import torch

from .. import log
from ..checkpoint import CheckpointInfo, CheckpointManager
from ..checkpoint.layout import ACCELERATE
from ..config import seconds_of
from ..engine.loop.preemption import Budget, StopFlag, integration_limit_s
from ..errors import EXIT_NOT_DURABLE, EXIT_RESUME, NothingToResume, ResumeNotApplied
from ..faults import Faults, installed
from ..storage.base import run_of
from . import hf_checkpoints as hf
from .hf_drive import DriveLink

__all__ = ["Position", "ResumableState", "checkpoints"]

SOURCE = "accelerate.Accelerator"


@dataclass(frozen=True)
class Position:
    """Where training stands: ``step`` optimizer steps done; ``batch`` batches of epoch ``epoch`` already trained
    (resume with ``accelerator.skip_first_batches(loader, batch)`` in that epoch, the whole loader after it)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0

    def to_json(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "batch": self.batch}

    @classmethod
    def from_manifest(cls, info: CheckpointInfo) -> Position:
        """The position a committed folder recorded, checked (a manifest is read back, not trusted)."""
        raw = (info.manifest or {}).get("position")
        values = [raw.get(k) if isinstance(raw, dict) else None for k in ("step", "epoch", "batch")]
        if not all(type(v) is int and v >= 0 for v in values) or values[0] != info.step:
            raise ResumeNotApplied(f"{info.path}: its manifest records no valid data position ({raw!r}; expected "
                                   f"step {info.step}, epoch and batch >= 0), so the loop cannot know where to go on. "
                                   f"Was it committed by resumable.integrations.accelerate? Move it away to resume "
                                   f"from the one before, or start a new run dir")
        return cls(*values)


def checkpoints(run_dir: str | os.PathLike[str], faults: Faults | None = None) -> CheckpointManager:
    """The ``checkpoint_N`` folders of ``RUN_DIR/checkpoints``."""
    return CheckpointManager(Path(run_dir) / "checkpoints", layout=ACCELERATE,
                             faults=faults if faults is not None else installed())


class ResumableState:
    """Commits, prunes, chooses and checks an Accelerator's checkpoints; stops in time (module docstring).

    ``run_dir``: where ``checkpoints/checkpoint_N`` go (default: ``accelerator.project_dir``). ``save_every``: save
    every that many steps in :meth:`step_end` (None: only at a stop, or when you call :meth:`save_state`). ``keep``:
    committed checkpoints kept (default ``total_limit``, else all). ``time_limit``: seconds or "2h" from now (None:
    Colab's VM lifetime or Kaggle's session limit there, no limit elsewhere; at most what ``resumable run
    --time-limit`` leaves). ``drive``: ``gdrive://...`` or a mounted Drive folder.
    """

    def __init__(self, accelerator: Any, run_dir: str | os.PathLike[str] | None = None, *,
                 save_every: int | None = None, keep: int | None = None, time_limit: str | float | None = None,
                 drive: str | None = None, flush_timeout: str | float = "10m", cache_dir: str | None = None,
                 credentials: str | None = None, faults: Faults | None = None) -> None:
        run_dir = run_dir if run_dir is not None else accelerator.project_dir
        if run_dir is None:
            raise ValueError("ResumableState needs a run_dir (or Accelerator(project_dir=...)): where checkpoints go")
        for name, value in (("save_every", save_every), ("keep", keep)):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name}={value!r} must be a whole number >= 1, or None")
        self.accelerator = accelerator
        self.run_dir = Path(run_dir)
        self.store = checkpoints(self.run_dir, faults)
        self.save_every = save_every
        self.keep = keep if keep is not None else accelerator.project_configuration.total_limit
        limit = seconds_of(time_limit, "time_limit")
        self.budget = Budget(integration_limit_s(limit))
        self.flush_timeout_s = seconds_of(flush_timeout, "flush_timeout") or 0.0
        self.link = (DriveLink(self.run_dir, drive, cache_dir, credentials, checkpoints=self.store)
                     if drive is not None else None)
        self.run_id: str | None = None
        self.position: Position | None = None  # the position loaded (Position() on a fresh start)
        self.stopped_early: str | None = None
        self.exit_code = 0
        self.last_commit_s = 0.0
        self._stop: StopFlag | None = None
        self._step_at: float | None = None
        self._step_s = 0.0
        self._save_s: float | None = None
        self._saved: Position | None = None  # the state last committed (or loaded): saving it again is a no-op

    # -- load ---------------------------------------------------------------------------------------------
    def load_state(self) -> Position:
        """Load the newest committed ``checkpoint_N`` whose every file verifies into the accelerator (newer ones are
        skipped with the reason), check that the RNG states it saved are the live ones, and return its position;
        ``Position()`` when there is none (a fresh start). Raises NothingToResume when there are committed
        checkpoints and none verifies, ResumeNotApplied when a state was not restored."""
        if self.link is not None:
            self.link.restore()  # a fresh VM: Drive's newest durable checkpoint, as checkpoint_N
        chosen = hf.newest_valid(self.store) if self.accelerator.is_main_process else self._newest_quietly()
        if chosen is None:
            committed = [info.path.name for info in self.store.inspect(deep=False) if info.committed]
            if committed:
                raise NothingToResume(f"{self.store.root} has committed checkpoints ({', '.join(committed)}) but "
                                      f"none verifies; refusing to start over on top of them. Delete them or use "
                                      f"another run dir")
            self.position = Position()
            self.run_id = uuid.uuid4().hex
            log.info(f"no checkpoint in {self.store.root}: starting fresh")
        else:
            position = Position.from_manifest(chosen)
            log.info(f"resuming from {chosen.path.name} ({chosen.path}): step {position.step}, epoch "
                     f"{position.epoch}, batch {position.batch}")
            self.accelerator.load_state(str(chosen.path))
            check_rng_restored(chosen.path, self.accelerator.process_index)
            self.position = self._saved = position
            self.run_id = run_of(chosen.manifest) or uuid.uuid4().hex
        self._begin()
        return self.position

    def _newest_quietly(self) -> CheckpointInfo | None:
        return self.store.latest_valid()[0]

    def skip(self, dataloader: Any, epoch: int) -> Any:
        """The batches of ``epoch`` still to train: the loaded position's epoch without its first ``batch``
        (``accelerator.skip_first_batches``), any later epoch whole."""
        position = self.position or Position()
        if epoch == position.epoch and position.batch > 0:
            if getattr(dataloader, "generator", None) is None:
                # torch's DataLoader draws each new iterator's seed from the global RNG when it has no generator of
                # its own: the uninterrupted run drew it at this epoch's start, the resumed one draws it again now
                log.warning("the DataLoader has no generator of its own, so starting it mid-epoch draws from torch's "
                            "global RNG once more than the uninterrupted run did (dropout masks then differ); pass "
                            "DataLoader(..., generator=torch.Generator().manual_seed(SEED)) for an identical resume")
            return self.accelerator.skip_first_batches(dataloader, position.batch)
        return dataloader

    def _begin(self) -> None:
        if self._stop is None:
            self._stop = StopFlag().__enter__()
        if self.link is not None and self.link.mirror is None and self.accelerator.is_main_process:
            self.link.start(self.run_id)
            link = self.link
            self.budget.durable_s = lambda n: link.mirror.pace.durable_s(n) if link.mirror is not None else 0.0
        self._step_at = time.monotonic()

    # -- save ---------------------------------------------------------------------------------------------
    def save_state(self, step: int, epoch: int, batch: int) -> CheckpointInfo | None:
        """``accelerator.save_state`` into ``checkpoint_<step>``, then the commit (manifest last, with the
        position) and retention. Returns the committed checkpoint (None on other processes than the main one)."""
        position = Position(step, epoch, batch)
        if self._saved is not None and self._saved.step == step:
            return None  # no step since the last commit or the load (a stop right after it, the end): it stays
        if self.run_id is None:
            self.run_id = uuid.uuid4().hex
        began = time.monotonic()
        accelerator = self.accelerator
        folder = self.store.folder(step)
        if accelerator.is_main_process:
            self.store.root.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(folder):
                self.store.delete(folder)  # a killed save's leftovers (or an older run's) are not mixed in
        accelerator.wait_for_everyone()
        config = accelerator.project_configuration
        naming, config.automatic_checkpoint_naming = config.automatic_checkpoint_naming, False
        try:  # its own naming would ignore the folder and rotate before writing: off for this save
            accelerator.save_state(str(folder))
        finally:
            config.automatic_checkpoint_naming = naming
        accelerator.wait_for_everyone()  # every rank's random_states_<rank>.pkl is written before rank 0 vouches
        info = None
        if accelerator.is_main_process:
            commit_began = time.monotonic()
            info = self.store.adopt(step, {"run_id": self.run_id, "source": SOURCE, "position": position.to_json(),
                                           "accelerate_version": accelerate.__version__})
            self.last_commit_s = time.monotonic() - commit_began
            self._prune(step)
            if self.link is not None:
                self.link.committed(step)
        accelerator.wait_for_everyone()
        self._saved = position
        self._save_s = time.monotonic() - began
        return info

    def _prune(self, newest: int) -> None:
        if self.keep is None:
            return
        uploading = self.link.mirror.protected() if self.link is not None and self.link.mirror else set()
        self.store.prune(self.keep, False, {newest, *uploading})

    # -- the loop -----------------------------------------------------------------------------------------
    def step_end(self, step: int, epoch: int, batch: int) -> bool:
        """Call after each optimizer step (``step`` done, ``batch`` batches of ``epoch`` done). Saves every
        ``save_every`` steps; on a stop signal or when the time budget would run out before the next step and its
        save, saves, commits and returns True: leave the loop and exit with :meth:`finish` (75)."""
        self.store.faults.after_step(step)  # chaos and the tests: a kill at an exact step (default: nothing)
        if self._stop is None:
            self._begin()
        now = time.monotonic()
        self._step_s, self._step_at = now - (self._step_at or now), now
        due = self.save_every is not None and step % self.save_every == 0
        reason = None
        if self._stop is not None and self._stop.requested:
            reason = f"signal {self._stop.requested}"
        elif not self.budget.fits(self._step_s, self._save_s if self._save_s is not None else self._step_s,
                                  saves=2 if due else 1):
            reason = "the session's time budget is spent"
        if reason is not None:
            log.info(f"stopping at step {step} ({reason}): saving and committing a checkpoint")
            self.save_state(step, epoch, batch)
            self.stopped_early, self.exit_code = reason, EXIT_RESUME
            log.info(f"stopped early ({reason}): {self.store.folder(step).name} committed. Run the same script "
                     f"again to continue (exit code {EXIT_RESUME})")
            return True
        if due:
            self.save_state(step, epoch, batch)
            self._step_at = time.monotonic()  # the save is not the next step's time
        return False

    def finish(self) -> int:
        """The end of a session: signal handlers given back, Drive uploads waited for (``flush_timeout``). Returns
        the exit code: 0; 75 stopped early with its state committed; 74 the newest checkpoint is only local."""
        if self._stop is not None:
            self._stop.__exit__(None, None, None)
            self._stop = None
        if self.link is not None and self.link.mirror is not None:
            self.link.mirror.flush(self.flush_timeout_s)
            newest = self.store.step_dirs()
            if newest:
                self._prune(newest[-1][0])  # the upload kept from retention is durable now
            if self.link.close(self.flush_timeout_s):
                self.exit_code = EXIT_NOT_DURABLE
        return self.exit_code


# -- the RNG check ------------------------------------------------------------------------------------------
def check_rng_restored(folder: Path, process_index: int = 0) -> None:
    """Raise ResumeNotApplied unless the live Python, NumPy, torch CPU (and CUDA) RNG states are those that
    ``accelerator.save_state`` wrote to ``folder/random_states_<process_index>.pkl``: Accelerate's ``load_state``
    logs a failed restore at INFO and goes on (accelerate#4283). Call it right after ``load_state``."""
    from accelerate.utils import load

    path = Path(folder) / f"random_states_{process_index}.pkl"
    fix = ("the resumed run would draw other dropout masks and shuffles than the run that saved it. Fix: resume with "
           "the torch, NumPy and accelerate versions that wrote it (its manifest.json records torch_version and "
           "accelerate_version), or start a new run dir")
    try:
        saved = load(path)
    except Exception as e:  # what accelerate swallowed: say it
        raise ResumeNotApplied(f"accelerator.load_state({folder}) could not restore the RNG states: {path.name} does "
                               f"not load ({type(e).__name__}: {e}); {fix}") from e
    if not isinstance(saved, dict):
        raise ResumeNotApplied(f"{path} holds {type(saved).__name__}, not accelerate's RNG states; {fix}")
    checks = [("Python random", lambda s: _same(random.getstate(), s), "random_state"),
              ("NumPy", lambda s: _same(np.random.get_state(), s), "numpy_random_seed"),
              ("torch CPU", lambda s: torch.equal(torch.get_rng_state(), s), "torch_manual_seed")]
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in saved:
        checks.append(("CUDA", lambda s: _same(torch.cuda.get_rng_state_all(), s), "torch_cuda_manual_seed"))
    differ = []
    for name, same, key in checks:
        try:
            ok = key in saved and bool(same(saved[key]))
        except (TypeError, ValueError, RuntimeError):
            ok = False
        if not ok:
            differ.append(name)
    if differ:
        raise ResumeNotApplied(f"accelerator.load_state({folder}) did not restore the {', '.join(differ)} RNG "
                               f"state(s) saved in {path.name} (accelerate logs 'Could not load random states' at "
                               f"INFO and goes on: accelerate#4283); {fix}")


def _same(a: Any, b: Any) -> bool:
    """Equal RNG states, as nested tuples, lists, arrays and tensors."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
