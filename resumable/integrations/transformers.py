"""Hugging Face ``Trainer`` runs that survive being killed: the three lines a training script adds.

>>> callback = ResumableCallback(time_limit="2h", drive="gdrive://root/runs/gpt2")  # doctest: +SKIP
>>> trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])  # doctest: +SKIP
>>> callback.train(trainer)  # trainer.train(resume_from_checkpoint=callback.latest_valid(...))  # doctest: +SKIP
>>> sys.exit(callback.exit_code)  # 75: stopped early with the state committed, run again  # doctest: +SKIP

What the callback adds to the Trainer's own checkpoints:

* **Commit.** Each ``checkpoint-N`` the Trainer saves gets resumable's ``manifest.json`` (size and sha256 of every
  file, written last and atomically, after the files were fsynced; ``on_save`` runs after the save). A folder
  without one, or with a file that does not match it, is never resumed from: :func:`latest_valid` skips it with the
  reason and takes the next older one, as ``resumable-train`` does.
* **Retention after the commit.** The Trainer's own ``save_total_limit`` rotation runs inside the save, *before*
  ``on_save``, ordered by mtime, and counts half-written folders: with ``save_total_limit=1`` a kill right after it
  leaves no committed checkpoint at all. The callback takes the limit over (the Trainer's is set to None at
  ``on_train_begin``) and prunes by step number only after a commit, manifest first; the best checkpoint stays.
* **Stop in time.** SIGTERM, SIGINT (the notebook's stop button), SIGUSR1, SIGHUP and the session budget (Colab's
  ~12 h VM lifetime by default in Colab, or ``time_limit``) make the Trainer save and stop at the next step
  boundary; the checkpoint is committed and :attr:`ResumableCallback.exit_code` is 75. A second Ctrl-C stops at
  once (the last committed checkpoint stays valid).
* **save_strategy="best".** The Trainer decides to save only after evaluating (a new best metric), after
  ``on_step_end``: the callback makes the same decision in ``on_evaluate`` and clears the folder's old manifest
  before the Trainer writes it, as for every other save. A stop that falls on an evaluation step without a new best
  (the Trainer then drops the stop's save) is saved at the ``on_epoch_end`` that follows the stop.
* **Drive.** With ``drive=`` (``gdrive://...`` or a mounted ``/content/drive/...`` folder) committed checkpoints are
  uploaded in the background (hf_drive.py), and on a fresh VM :meth:`ResumableCallback.latest_valid` first brings
  the newest durable one back.

The equivalence of a killed-and-resumed run with an uninterrupted one is the Trainer's own (it saves the RNG states
and skips the batches already trained); docs/trainer.md says what scripts/bench_trainer_resume.py
measured.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .. import log
from ..checkpoint.layout import TRAINER
from ..config import seconds_of
from ..engine.loop.preemption import Budget, StopFlag, integration_limit_s
from ..engine.state.determinism import version_difference
from ..errors import EXIT_NOT_DURABLE, EXIT_RESUME, NothingToResume
from ..storage.base import run_of
from . import hf_checkpoints as hf
from .hf_drive import DriveLink

__all__ = ["ResumableCallback", "finished_at", "latest_valid", "load_finished", "restore"]


def restore(output_dir: str | os.PathLike[str], drive: str, cache_dir: str | None = None,
            credentials: str | None = None) -> int | None:
    """Bring the newest durable checkpoint on ``drive`` back into ``output_dir`` as ``checkpoint-N`` when no local
    one is as new (a fresh VM); returns its step, or None. Call it before ``trainer.train``."""
    return DriveLink(output_dir, drive, cache_dir, credentials).restore()


def latest_valid(output_dir: str | os.PathLike[str], drive: str | None = None) -> str | None:
    """The newest committed ``checkpoint-N`` in ``output_dir`` whose every file verifies, for
    ``trainer.train(resume_from_checkpoint=...)``; None when there is none (a fresh start). Newer folders are
    skipped with the reason ("skipping checkpoint-N (...): no manifest.json (the save did not finish)").

    ``drive``: first bring Drive's newest durable checkpoint back (:func:`restore`). Raises NothingToResume when
    there are committed checkpoints and none verifies: starting over would train over them."""
    if drive is not None:
        restore(output_dir, drive)
    store = hf.checkpoints(output_dir)
    chosen = hf.newest_valid(store)
    if chosen is not None:
        log.info(f"resuming from {chosen.path.name} ({chosen.path})")
        note = versions_note(chosen.manifest)
        if note is not None:
            log.warning(note)
        return str(chosen.path)
    committed = [info.path.name for info in store.inspect(deep=False) if info.committed]
    if committed:
        raise NothingToResume(f"{output_dir} has committed checkpoints ({', '.join(committed)}) but none verifies; "
                              f"refusing to start over on top of them. Delete them or use another output_dir")
    return None


def versions_note(manifest: dict[str, Any] | None) -> str | None:
    """One line when ``manifest`` was written by another torch major.minor or another transformers major (None: the
    same, or not recorded): the checkpoint resumes, bit-identity is only promised on the same versions."""
    manifest = manifest or {}
    torch_then, hf_then = manifest.get("torch_version"), manifest.get("transformers_version")
    torch_differs = version_difference(torch_then) is not None
    hf_differs = _major(hf_then) is not None and _major(hf_then) != _major(transformers.__version__)
    if not (torch_differs or hf_differs):
        return None
    then = " and ".join(f"{name} {v}" for name, v, d in (("torch", torch_then, torch_differs),
                                                         ("transformers", hf_then, hf_differs)) if d)
    now = " and ".join(f"{name} {v}" for name, v, d in (("torch", torch.__version__, torch_differs),
                                                        ("transformers", transformers.__version__, hf_differs)) if d)
    return (f"this checkpoint was written with {then} and this session runs {now}: it resumes, but bit-identity with "
            f"an uninterrupted run is only promised on the same versions")


def _major(version: Any) -> str | None:
    return version.split(".", 1)[0] if isinstance(version, str) and version[:1].isdigit() else None


def finished_at(checkpoint: str | os.PathLike[str], args: TrainingArguments) -> int | None:
    """The step at which ``checkpoint`` (a ``checkpoint-N`` folder) completed the training ``args`` ask for, or
    None when there is more to train: ``max_steps`` when set, else the epochs (more epochs asked than the
    checkpoint's run had: not complete)."""
    try:
        saved = json.loads((Path(checkpoint) / "trainer_state.json").read_text(encoding="utf-8"))
        step, planned, epochs = int(saved["global_step"]), int(saved["max_steps"]), saved.get("num_train_epochs")
    except (OSError, ValueError, KeyError, TypeError):  # verified by its manifest, so not expected: train then
        return None
    if args.max_steps is not None and args.max_steps > 0:
        target = args.max_steps
    elif isinstance(epochs, (int, float)) and args.num_train_epochs > epochs:
        return None
    else:
        target = planned
    return step if 0 < target <= step else None


class ResumableCallback(TrainerCallback):
    """Commits the Trainer's checkpoints, stops it in time, mirrors it to Drive (see the module docstring).

    ``time_limit``: seconds or a duration ("90m", "2h") from the callback's creation (at most what
    ``resumable run --time-limit`` leaves); None: Colab's VM lifetime or Kaggle's session limit less 20 min (counted
    from the VM's boot, or the Kaggle container's start), no limit elsewhere. ``drive``: where committed
    checkpoints are mirrored. ``flush_timeout``: how long the end of ``train`` waits for uploads.

    After ``train`` returns: :attr:`stopped_early` (the reason, or None) and :attr:`exit_code` (0; 75 stopped early
    with its checkpoint committed; 74 the newest checkpoint is not yet durable on Drive).
    """

    def __init__(self, time_limit: str | float | None = None, drive: str | None = None, *,
                 flush_timeout: str | float = "10m", cache_dir: str | None = None,
                 credentials: str | None = None) -> None:
        limit = seconds_of(time_limit, "time_limit")
        self.budget = Budget(integration_limit_s(limit))
        self.drive = drive
        self.flush_timeout_s = seconds_of(flush_timeout, "flush_timeout") or 0.0
        self._drive_options = {"cache_dir": cache_dir, "credentials": credentials}
        self.stopped_early: str | None = None
        self.exit_code = 0
        self.keep: int | None = None  # save_total_limit, applied after each commit
        self.run_id: str | None = None
        self.last_commit_s = 0.0  # how long the last commit took (hashing, fsync): the callback's cost per save
        self._link: DriveLink | None = None
        self._stop: StopFlag | None = None
        self._step_at = 0.0
        self._step_s = 0.0
        self._save_s: float | None = None
        self._save_began: float | None = None
        self._saved_at: int | None = None  # the step of this train()'s last on_save
        self._training = False  # between on_train_begin and on_train_end (on_evaluate also fires outside)

    # -- before train -----------------------------------------------------------------------------------
    def _drive_link(self, output_dir: str) -> DriveLink | None:
        if self.drive is not None and self._link is None:
            self._link = DriveLink(output_dir, self.drive, **self._drive_options)
        return self._link

    def latest_valid(self, output_dir: str | os.PathLike[str]) -> str | None:
        """:func:`latest_valid`, Drive's newest checkpoint brought back first when ``drive`` is set."""
        link = self._drive_link(str(output_dir))
        if link is not None:
            link.restore()
        chosen = latest_valid(output_dir)
        if chosen is not None:
            step = TRAINER.parse(Path(chosen).name)
            self.run_id = run_of(hf.checkpoints(output_dir).check(step, Path(chosen), deep=False).manifest)
        return chosen

    def train(self, trainer: Any, **kwargs: Any) -> Any:
        """``trainer.train`` from the newest valid checkpoint (:meth:`latest_valid`); returns what it returns, or
        None without training when that checkpoint already completed the run (a notebook cell run again after the
        end). transformers trains one more step when resumed from a checkpoint whose ``max_steps`` ends inside an
        epoch, which would change the finished model and write a ``checkpoint-<max_steps + 1>``."""
        resume = self.latest_valid(trainer.args.output_dir)
        done = finished_at(resume, trainer.args) if resume is not None else None
        if done is not None:
            load_finished(trainer, resume)
            log.info(f"training is already complete at step {done} ({resume}); not training again: trainer.model holds "
                     f"its final weights and trainer.state its log history")
            self.stopped_early, self.exit_code = None, 0
            return None
        return trainer.train(resume_from_checkpoint=resume, **kwargs)

    # -- TrainerCallback ----------------------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if args.save_total_limit is not None and args.save_total_limit > 0:
            self.keep = args.save_total_limit
            args.save_total_limit = None  # the Trainer's rotation runs before the commit: this callback's after it
            log.info(f"save_total_limit={self.keep} is applied by ResumableCallback after each checkpoint is "
                     f"committed (the Trainer's own rotation runs before, and could leave none committed)")
        self.run_id = self.run_id or hf.newest_run_id(hf.checkpoints(args.output_dir)) or uuid.uuid4().hex
        if state.is_world_process_zero:
            link = self._drive_link(args.output_dir)
            if link is not None and link.mirror is None:
                link.start(self.run_id)
                # the final checkpoint must be on Drive, not only on this disk, before the VM goes
                self.budget.durable_s = lambda n: link.mirror.pace.durable_s(n) if link.mirror is not None else 0.0
        if self._stop is not None:  # a previous train() raised before on_train_end: its handlers go first
            self._stop.__exit__(None, None, None)
        self._stop = StopFlag().__enter__()
        self.stopped_early, self.exit_code = None, 0  # the same callback may serve another train() call
        self._step_at = time.monotonic()
        self._saved_at, self._training = None, True

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        now = time.monotonic()
        self._step_s, self._step_at = now - self._step_at, now
        if state.global_step < state.max_steps and self.stopped_early is None:
            reason = None
            if self._stop is not None and self._stop.requested:
                reason = f"signal {self._stop.requested}"
            elif not self.budget.fits(self._step_s, self._save_s if self._save_s is not None else self._step_s,
                                      saves=2 if _may_save(args, control) else 1):  # the Trainer saves here
                reason = "the session's time budget is spent"
            if reason is not None:
                self.stopped_early = reason
                control.should_save = True
                control.should_training_stop = True
                log.info(f"stopping at step {state.global_step} ({reason}): saving and committing a checkpoint")
        if control.should_save:
            self._before_save(args, state)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.stopped_early is not None and self._saved_at != state.global_step:
            # save_strategy="best": the Trainer evaluated at the stop's step and, with no new best, replaced the
            # stop's should_save by False. The Trainer always ends the epoch after a stop, and saves here when
            # asked (it evaluates here only with eval_strategy="epoch", whose steps never evaluate, so the stop's
            # save went through at its step and this is not reached).
            control.should_save = True
        if control.should_save:
            self._before_save(args, state)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, float] | None = None, **kwargs: Any) -> None:
        # save_strategy="best": the Trainer sets should_save right after this event, when the metric is a new best
        # (Trainer._determine_best_metric), and saves at once; no event comes between, so the decision is made here.
        if self._training and _saves_on_best(args) and _new_best(args, state, metrics or {}):
            self._before_save(args, state)

    def _before_save(self, args: TrainingArguments, state: TrainerState) -> None:
        """The Trainer is about to write checkpoint-N: a manifest left there (a resume from an older checkpoint
        writes the step again) must not vouch for the folder while its files are replaced."""
        self._save_began = time.monotonic()
        if state.is_world_process_zero:
            hf.checkpoints(args.output_dir).invalidate(state.global_step)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        _barrier()  # every rank has written its files (rng_state_K.pth) before rank 0 vouches for them
        step = self._saved_at = state.global_step
        if state.is_world_process_zero:
            began = time.monotonic()
            hf.checkpoints(args.output_dir).adopt(step, {"run_id": self.run_id, "source": "transformers.Trainer",
                                                         "transformers_version": transformers.__version__})
            self.last_commit_s = time.monotonic() - began
            self._prune(args, state)
            if self._link is not None:
                self._link.committed(step)
        _barrier()
        if self._save_began is not None:
            self._save_s = time.monotonic() - self._save_began
            self._save_began = None
        if self.stopped_early is not None:
            self.exit_code = EXIT_RESUME
            log.info(f"stopped early ({self.stopped_early}): checkpoint-{step} committed. Run the same script again "
                     f"to continue (exit code {EXIT_RESUME})")

    def _prune(self, args: TrainingArguments, state: TrainerState) -> None:
        """``save_total_limit`` applied after a commit: the best checkpoint and one being uploaded stay."""
        if self.keep is None:
            return
        best = state.best_model_checkpoint and TRAINER.parse(Path(state.best_model_checkpoint).name)
        uploading = self._link.mirror.protected() if self._link is not None and self._link.mirror else set()
        hf.checkpoints(args.output_dir).prune(self.keep, False, {*([best] if best is not None else []), *uploading})

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._training = False
        if self._stop is not None:
            self._stop.__exit__(None, None, None)
            self._stop = None
        if self._link is not None and self._link.mirror is not None:
            if state.is_world_process_zero:
                # The upload in flight at the last save was kept from retention; once it is durable, the last save's
                # retention applies in full, here and (through close's last pass) on Drive.
                self._link.mirror.flush(self.flush_timeout_s)
                self._prune(args, state)
            if self._link.close(self.flush_timeout_s):
                self.exit_code = EXIT_NOT_DURABLE
            self._link = None


def load_finished(trainer: Any, checkpoint: str) -> None:
    """A session that finds the run complete leaves the Trainer as the ``train()`` that completed it did: the final
    checkpoint's weights in ``trainer.model`` (through the Trainer's own loader: safetensors, sharded, PEFT adapters)
    and its state (``global_step``, ``log_history``) in ``trainer.state``."""
    load = getattr(trainer, "_load_from_checkpoint", None)
    if load is None:  # a transformers without it: the weights stay as built, and say so
        log.warning(f"this transformers version has no Trainer._load_from_checkpoint: trainer.model keeps the weights "
                    f"it was built with; load {checkpoint} yourself to use the trained model")
    else:
        load(checkpoint)
    trainer.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))


def _saves_on_best(args: TrainingArguments) -> bool:
    return args.save_strategy == "best"  # SaveStrategy is a str enum; older transformers have no "best"


def _may_save(args: TrainingArguments, control: TrainerControl) -> bool:
    """Whether the Trainer may save at this step: asked to, or it evaluates under save_strategy="best"."""
    return control.should_save or (_saves_on_best(args) and control.should_evaluate)


def _new_best(args: TrainingArguments, state: TrainerState, metrics: dict[str, float]) -> bool:
    """Trainer._determine_best_metric's decision, before it is made: ``metric_for_best_model`` (``eval_``
    prefixed) strictly better than ``state.best_metric`` (none yet: any number but NaN)."""
    name = args.metric_for_best_model
    if not name:
        return False
    try:
        value = float(metrics[name if name.startswith("eval_") else f"eval_{name}"])
    except (KeyError, TypeError, ValueError):
        return False  # not in this evaluation's metrics (another eval dataset of several): no save from this one
    best = state.best_metric
    if args.greater_is_better:
        return value > (best if best is not None else float("-inf"))
    return value < (best if best is not None else float("inf"))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
