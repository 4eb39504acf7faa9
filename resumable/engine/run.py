"""The public API: make your own training loop resumable.

::

    run = resumable.Run("runs/mine", model=model, optimizer=optimizer, scheduler=scheduler,
                        data=train_set, batch_size=64, epochs=10, num_workers=2, evaluate=evaluate)
    for epoch, step, (x, y) in run:          # resumes from the newest valid checkpoint, if any
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        run.log(loss)

A :class:`Run` is the same engine ``resumable-train`` uses: it restores model, optimizer, scheduler, scaler,
extra ``Stateful`` objects and every RNG stream, starts the data at the saved batch, checkpoints on steps,
wall clock, the session budget and signals (asynchronously by default), and stores to a local folder, a
mounted Drive folder or ``gdrive://``. After the loop, ``run.finished`` says whether training is complete;
otherwise it stopped early with its state committed, and running the same code again continues.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointInfo, CheckpointManager, InvalidCheckpoint, checkpoints_dir, describe_age
from ..checkpoint.writer import CheckpointWriter, SaveFailed, SaveStats
from ..config import RunOptions, format_duration, parse_duration
from ..errors import ConfigMismatch, NothingToResume, ResumableError, RunDirInUse
from ..reporting.history import SessionLog
from ..reporting.metrics import MetricsLog
from ..reporting.tensorboard import TENSORBOARD_DIR, TensorBoardLog
from ..storage import RunLocation, StorageError, open_run_location
from ..storage.lease import DriveLease
from ..storage.tiered import Mirror, restore_newest
from .checkpointer import Session
from .data import IndexBatches, LoaderBatches
from .distributed import Distributed
from .lock import RunLock
from .loop import Loop, LoopPlan, Outcome
from .preemption import EXIT_RESUME, Budget, StopFlag, colab_default_limit_s, process_age_s
from .sampler import ResumableSampler
from .state import Stateful, TrainState
from .triggers import SaveTriggers

_ACTIVE: dict[str, Run] = {}  # open runs of this process by run dir (a re-run notebook cell)


def say(message: str) -> None:
    print(f"resumable: {message}", file=sys.stderr, flush=True)


def plain_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose state dict is checkpointed: inside ``torch.compile`` (``_orig_mod``) and
    ``DistributedDataParallel`` (``module``) wrappers, so keys carry no prefix and a checkpoint loads into the
    plain model, with or without those wrappers, on any number of GPUs."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def open_location(run_dir: str, cache_dir: str | None, credentials: str | None, restore: bool) -> RunLocation:
    """Open the run dir; for a Drive run dir bring back a checkpoint newer than the local cache's."""
    try:
        location = open_run_location(run_dir, cache_dir, credentials)
    except (StorageError, ValueError) as e:
        raise ResumableError(str(e)) from e
    if location.remote is not None:
        say(f"run dir {run_dir} is mirrored from a local cache in {location.local_dir}")
        if restore:
            try:
                restore_newest(location.remote, CheckpointManager(checkpoints_dir(location.local_dir)),
                               location.local_dir, say)
            except StorageError as e:
                raise ResumableError(f"cannot look for checkpoints on {location.remote.description}: {e}. "
                                     f"Nothing was changed; run again when it is reachable") from e
    return location


def choose_checkpoint(manager: CheckpointManager, run_dir: str, mode: str,
                      overwrite: bool) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
    """The checkpoint to resume (None: start fresh) and newer ones that failed verification; modifies nothing.

    ``mode``: ``auto`` resumes when there is a valid checkpoint, ``resume`` requires one, ``fresh`` starts over
    (and needs ``overwrite`` to discard existing checkpoints)."""
    committed = [i for i in manager.inspect(deep=False) if i.committed]
    if mode == "fresh":
        if committed and not overwrite:
            raise RunDirInUse(f"{run_dir} already has {len(committed)} checkpoint(s) (newest step "
                              f"{committed[-1].step}); --fresh would discard them. Add --overwrite to delete them, "
                              f"or choose another --run-dir")
        return None, []
    latest, skipped = manager.latest_valid()  # hashes newest-first, stops at the first valid one
    if latest is not None:
        return latest, skipped
    if mode == "resume":
        found = "; ".join(f"step {i.step}: {i.reason}" for i in skipped[::-1]) or "no checkpoints at all"
        raise NothingToResume(f"--resume needs a valid checkpoint in {manager.root}, found: {found}. "
                              f"Run without --resume to start fresh")
    if committed:
        found = "; ".join(f"step {i.step}: {i.reason}" for i in skipped[::-1] if i.committed)
        raise NothingToResume(f"{run_dir} has checkpoints but none is valid ({found}); refusing to start over "
                              f"on top of them. Use --fresh --overwrite to discard them, or another --run-dir")
    return None, []


def agree_on_start(dist: Distributed, run_dir: str, cache_dir: str | None, credentials: str | None, mode: str,
                   overwrite: bool) -> tuple[RunLocation, tuple[CheckpointInfo | None, list[CheckpointInfo]]]:
    """Open the run dir and pick the checkpoint to resume (see :func:`choose_checkpoint`).

    Under DDP rank 0 does it (bringing a Drive checkpoint back first) and tells the others, which then open
    the same run dir; an error on rank 0 is raised on every rank instead of leaving them waiting."""
    if dist.main:
        try:
            location = open_location(run_dir, cache_dir, credentials, restore=not (mode == "fresh" and overwrite))
            chosen = choose_checkpoint(CheckpointManager(checkpoints_dir(location.local_dir)), run_dir, mode,
                                       overwrite)
        except ResumableError as e:
            dist.broadcast(e)
            raise
        dist.broadcast(chosen)
        return location, chosen
    chosen = dist.broadcast(None)
    if isinstance(chosen, ResumableError):
        raise chosen
    try:
        return open_run_location(run_dir, cache_dir, credentials), chosen
    except (StorageError, ValueError) as e:
        raise ResumableError(str(e)) from e


def check_computation(saved: dict[str, Any], current: dict[str, Any], run_dir: str) -> None:
    for key in sorted(set(saved) | set(current)):
        default = "none" if key == "amp" else None  # checkpoints from before --amp existed
        if saved.get(key, default) != current.get(key, default):
            raise ConfigMismatch(key, saved.get(key, default), current.get(key, default), run_dir)


def _budget(options: RunOptions) -> Budget:
    start = time.monotonic() - process_age_s()
    if options.time_limit_s is not None:
        return Budget(options.time_limit_s, start=start)
    colab = colab_default_limit_s()
    if colab is not None:
        say(f"Colab detected: stopping cleanly after {format_duration(colab)} (before the 12 h VM limit, "
            f"counted from VM start); pass --time-limit to change it")
        return Budget(colab)
    return Budget(None)


def _triggers(options: RunOptions) -> SaveTriggers:
    if options.checkpoint_every == "auto":
        return SaveTriggers(options.checkpoint_steps, None, auto_mtbf_s=parse_duration(options.mtbf))
    return SaveTriggers(options.checkpoint_steps, options.checkpoint_every_s)


def _as_source(data: Any, loader_options: dict[str, Any]) -> tuple[Any, int]:
    if isinstance(data, IndexBatches):
        return data, data.size
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return LoaderBatches(data, **loader_options), len(data)
    raise TypeError(f"data must be a map-style Dataset (with __getitem__ and __len__) or resumable.IndexBatches, "
                    f"not {type(data).__name__}")


class Run:
    """A resumable training run over ``data`` (see the module docstring for the loop).

    Iterating yields ``(epoch, step, batch)``: ``epoch`` counts from 0 and ``step`` is the number of optimizer
    steps done before this batch (so it is also the 0-based index of the step the batch belongs to).

    ``data`` is a map-style ``Dataset`` (loaded through a ``DataLoader`` with ``num_workers``, ``collate_fn``,
    ``pin_memory`` and any other ``loader_options``) or :class:`resumable.IndexBatches` for tensors already on
    the device. ``evaluate()`` runs after each epoch and returns metrics (``test_acc`` picks the best
    checkpoint). ``objects`` adds more ``Stateful`` things to checkpoint (an EMA, a custom sampler...).
    ``accumulate=K`` makes a step K micro-batches: call ``optimizer.step()`` when ``run.sync_step`` is true;
    checkpoints are only taken between steps. ``config`` (JSON-able) is recorded and must match on resume.
    ``resume``: ``auto`` (default) continues from the newest valid checkpoint, ``must`` requires one,
    ``never`` starts over (``overwrite=True`` discards existing checkpoints). Other keyword arguments are
    :class:`~resumable.config.RunOptions` (``max_steps``, ``checkpoint_every="5m"``, ``checkpoint_steps``,
    ``time_limit``, ``keep``, ``tensorboard``, ``cache_dir``...).
    """

    def __init__(self, run_dir: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 data: Any, batch_size: int, epochs: int = 1, seed: int = 0,
                 scheduler: Stateful | None = None, scaler: Stateful | None = None,
                 objects: Mapping[str, Stateful] | None = None,
                 evaluate: Callable[[], Mapping[str, float]] | None = None, accumulate: int = 1,
                 shuffle: bool = True, drop_last: bool = False, num_workers: int = 0,
                 collate_fn: Callable | None = None, pin_memory: bool = False,
                 loader_options: Mapping[str, Any] | None = None, device: torch.device | str | None = None,
                 config: Mapping[str, Any] | None = None, resume: str = "auto", overwrite: bool = False,
                 prepared: tuple[RunLocation, tuple[CheckpointInfo | None, list[CheckpointInfo]]] | None = None,
                 **options: Any) -> None:
        if resume not in ("auto", "must", "never"):
            raise ValueError(f"resume={resume!r} must be auto, must or never")
        if accumulate < 1:
            raise ValueError(f"accumulate={accumulate} must be at least 1")
        self.run_dir = str(run_dir)
        self.options = RunOptions(epochs=epochs, **options)
        self.model = model
        self.optimizer = optimizer
        loader = {"num_workers": num_workers, "collate_fn": collate_fn, "pin_memory": pin_memory,
                  **(loader_options or {})}
        self.source, size = _as_source(data, {k: v for k, v in loader.items() if v is not None})
        self.dist = Distributed.current()  # torchrun: the user (or resumable-train) initialised the group
        self.sampler = ResumableSampler(size, batch_size, seed, shuffle=shuffle, drop_last=drop_last,
                                        rank=self.dist.rank, world_size=self.dist.world_size)
        self.accumulate = accumulate
        self.evaluate = evaluate
        self.device = torch.device(device) if device is not None else _device_of(model)
        self._objects: dict[str, Stateful | None] = {"model": plain_module(model), "optimizer": optimizer,
                                                     "scheduler": scheduler, "scaler": scaler,
                                                     "sampler": self.sampler}
        for name, obj in (objects or {}).items():
            if name in self._objects:
                raise ValueError(f"objects={{{name!r}: ...}} clashes with a built-in checkpoint entry; rename it")
            self._objects[name] = obj
        self.computation: dict[str, Any] = {"batch_size": batch_size, "seed": seed, "accumulate": accumulate,
                                            "num_samples": size, "shuffle": shuffle, "drop_last": drop_last,
                                            "config": dict(config) if config is not None else None}
        # Recorded in every manifest; ``computation`` is what a checkpoint must match to be resumed.
        self.settings: dict[str, Any] = {**asdict(self.options), **self.computation}
        self.mode = {"auto": "auto", "must": "resume", "never": "fresh"}[resume]
        self.overwrite = overwrite
        self.state = TrainState()
        self.outcome: Outcome | None = None
        self.sync_step = True  # this micro-batch completes an optimizer step (see accumulate)
        self.end_of_epoch = False  # this batch is the epoch's last (step a per-epoch scheduler here)
        self.resumed_from: int | None = None
        # resumable-train opens the run dir and picks the checkpoint itself (its options come from it).
        self._location, self._checkpoint = prepared if prepared is not None else (None, None)
        self._loop: Loop | None = None
        self._iterator: Iterator[tuple[int, int, Any]] | None = None

    # -- results -----------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.outcome is not None and self.outcome.finished

    @property
    def exit_code(self) -> int:
        """0 when training is complete, 75 (EX_TEMPFAIL) when it stopped early with its state committed."""
        return 0 if self.finished else EXIT_RESUME

    @property
    def stats(self) -> SaveStats | None:
        """Checkpoint figures of this session (None before training started)."""
        session = getattr(self, "_session", None)
        return session.writer.stats if session is not None else None

    def log(self, loss: torch.Tensor) -> None:
        """Report the loss of the batch just trained (not synced): train loss per epoch and log records."""
        if self._loop is not None:
            self._loop.report_loss(loss)

    # -- the loop ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        if self._iterator is not None:
            raise RuntimeError("this Run is already being iterated; make a new Run to train again")
        self._iterator = self._iterate()
        return self._iterator

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop iterating (no new checkpoint; the newest committed one stays) and release the run dir."""
        if self._iterator is not None:
            self._iterator.close()

    def _iterate(self) -> Iterator[tuple[int, int, Any]]:
        previous = _ACTIVE.get(self.run_dir)
        if previous is not None and previous is not self:  # before choosing: its last save may still commit
            say(f"closing the previous Run on {self.run_dir} in this process (a re-run notebook cell?)")
            previous.close()
        self._prepare()
        location = self._location
        assert location is not None
        lock = RunLock(location.local_dir) if self.dist.main else None  # rank 0 owns the run dir
        lease = DriveLease(location.remote) if location.remote is not None and self.dist.main else None
        try:
            taken_over = lock.acquire() if lock is not None else None  # raises RunDirInUse
            _ACTIVE[self.run_dir] = self
            if lease is not None:
                try:
                    taken_over = lease.acquire() or taken_over
                except StorageError as e:
                    raise ResumableError(f"cannot take the lease on {location.remote.description}: {e}") from e
        except ResumableError as e:
            self.dist.broadcast(e)  # the other ranks stop too
            self._release(location, lock, lease)
            raise
        refused = self.dist.broadcast(None)
        if isinstance(refused, ResumableError):
            raise refused
        try:
            if taken_over:
                say(taken_over)
            yield from self._locked()
        finally:
            self._release(location, lock, lease)

    def _release(self, location: RunLocation, lock: RunLock | None, lease: DriveLease | None) -> None:
        if lease is not None:
            lease.release()
        if _ACTIVE.get(self.run_dir) is self:
            del _ACTIVE[self.run_dir]
        if lock is not None:
            lock.release()

    def _prepare(self) -> None:
        """Open the run dir, pick the checkpoint and restore it (before the lock: nothing is modified).

        Under DDP rank 0 opens the run dir (bringing a Drive checkpoint back) and picks the checkpoint; the
        other ranks wait for its choice, then every rank loads the same checkpoint."""
        if self._location is None or self._checkpoint is None:
            self._location, self._checkpoint = agree_on_start(self.dist, self.run_dir, self.options.cache_dir,
                                                              self.options.drive_credentials, self.mode,
                                                              self.overwrite)
        run_dir = self._location.local_dir
        manager = CheckpointManager(checkpoints_dir(run_dir))
        main = self.dist.main
        self._metrics = MetricsLog(run_dir / "metrics.jsonl" if main else None)
        remote = self._location.remote if main else None
        self._mirror = Mirror(manager, remote, run_dir, say) if remote is not None else None
        self._tensorboard = TensorBoardLog(run_dir) if self.options.tensorboard and main else None
        self._session = Session(
            manager, self._objects, self.state,
            meta={"config": self.settings, "computation": self.computation, "device": str(self.device),
                  "world_size": self.dist.world_size},
            keep=self.options.keep, keep_best=self.options.keep_best,
            writer=CheckpointWriter(asynchronous=not self.options.sync_checkpoints), before_commit=self._durable,
            after_commit=self._mirror.submit if self._mirror is not None else None, dist=self.dist)
        latest, skipped = self._checkpoint
        if latest is not None:
            self._resume(latest, skipped)
        self.dist.barrier()  # every rank has loaded before rank 0 starts changing the run dir

    def _durable(self) -> None:
        self._metrics.sync()
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def _resume(self, latest: CheckpointInfo, skipped: list[CheckpointInfo]) -> None:
        """Restore the newest checkpoint that verifies and loads, warning about each one skipped."""
        manager = self._session.manager
        candidates = [*skipped, latest]
        older = (manager.check(step, path, deep=True) for step, path in reversed(manager.step_dirs())
                 if step < latest.step)
        for info in (*candidates, *older):
            if not info.valid:
                say(f"warning: skipping checkpoint step {info.step} ({info.path}): {info.reason}")
                continue
            check_computation(info.manifest.get("computation", {}), self.computation, self.run_dir)
            threads = info.manifest.get("num_threads")
            if isinstance(threads, int) and threads != torch.get_num_threads():
                say(f"setting torch threads to {threads} (was {torch.get_num_threads()}) as recorded in the "
                    f"checkpoint, so CPU results stay bit-identical")
                torch.set_num_threads(threads)
            try:
                self._session.restore(info)
            except InvalidCheckpoint as e:  # raised before any object is modified
                say(f"warning: skipping checkpoint step {info.step} ({info.path}): {e}")
                continue
            except (RuntimeError, ValueError, KeyError) as e:
                detail = " ".join(str(e).split())  # torch's message spans lines; the error stays one line
                raise ResumableError(f"the checkpoint {info.path} does not fit this model/optimizer ({detail}); "
                                     f"use the matching options, or start over with --fresh --overwrite") from e
            self.resumed_from = info.step
            saved_world = info.manifest.get("world_size", 1)
            if saved_world != self.dist.world_size:
                self._remap_position(saved_world)
            say(f"resuming from step {info.step} (epoch {self.state.epoch}, batch {self.state.batch_in_epoch}), "
                f"saved {describe_age(info.created)}")
            return
        raise ResumableError("no checkpoint could be loaded (see the warnings above); start over with --fresh "
                             "--overwrite or use another --run-dir")

    def _remap_position(self, saved_world: int) -> None:
        """Resume with another number of processes: keep the position in the epoch by sample count."""
        state, sampler = self.state, self.sampler
        samples = state.batch_in_epoch * sampler.batch_size * saved_world
        batch = min(samples // sampler.global_batch, sampler.batches_per_epoch)
        batch -= batch % self.accumulate
        if self.dist.main:
            say(f"warning: the checkpoint was written by {saved_world} process(es), this run has "
                f"{self.dist.world_size}: the position in epoch {state.epoch + 1} is remapped by sample count "
                f"(batch {state.batch_in_epoch} → {batch}). Training continues, but is not bit-identical to a run "
                f"that kept one world size")
        state.batch_in_epoch = batch

    def _locked(self) -> Iterator[tuple[int, int, Any]]:
        """Everything that modifies the run dir, under its lock."""
        location, session, state = self._location, self._session, self.state
        assert location is not None
        run_dir, manager, main = location.local_dir, session.manager, self.dist.main
        if self.mode == "fresh" and self.overwrite and main:
            manager.delete_all()
            for name in ("metrics.jsonl", "sessions.jsonl"):
                (run_dir / name).unlink(missing_ok=True)
            shutil.rmtree(run_dir / TENSORBOARD_DIR, ignore_errors=True)
            if location.remote is not None:
                for folder in [*location.remote.list_checkpoints(), TENSORBOARD_DIR]:
                    location.remote.delete_folder(folder)
            if self._mirror is not None:
                self._mirror.durable.clear()  # those were just deleted: the new run's steps must all be uploaded
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            manager.cleanup_incomplete()
            self._metrics.rollback(state.step)
        if self._tensorboard is not None:
            self._tensorboard.open(self.resumed_from)
            self._metrics.on_record = self._tensorboard.record
        plan = LoopPlan(epochs=self.options.epochs, max_steps=self.options.max_steps,
                        log_every=self.options.log_every, progress=self.options.progress and main,
                        on_save_error=self.options.on_save_error, accumulate=self.accumulate)
        sessions = SessionLog(run_dir if main else None)
        ended = "interrupted"  # the loop was left by break, an exception or close()
        with StopFlag() as stop:
            loop = Loop(session, self.sampler, plan, self._metrics, self._end_epoch, self._current_lr, self.device,
                        triggers=_triggers(self.options), stop=stop, budget=_budget(self.options),
                        on_interval=self._announce_interval if self.options.checkpoint_every == "auto" else None,
                        dist=self.dist)
            self._loop = loop
            if loop.finished() and self.resumed_from is not None:
                say(f"run in {self.run_dir} is already complete at step {state.step} (epoch {state.epoch}); "
                    f"raise epochs or max_steps to train further")
                self.outcome = Outcome(True, "finished")
                self._close_quietly()
                return
            ranks = f" (rank {self.dist.rank} of {self.dist.world_size})" if self.dist.active else ""
            say(f"training on {self.device}{ranks} with {torch.get_num_threads()} CPU thread(s): step {state.step} → "
                f"{loop.total_steps}, checkpoints in {manager.root}")
            sessions.start(state.step, self.resumed_from)
            try:
                yield from self._batches(loop)
                self.outcome = loop.outcome
                ended = loop.outcome.reason if loop.outcome is not None else ended
            except SaveFailed as e:
                ended = "save error"
                latest, _ = manager.latest_valid()
                where = f"step {latest.step}" if latest else "none"
                raise SaveFailed(f"{e}. The newest valid checkpoint is {where}; fix the cause (disk space, "
                                 f"permissions, storage) and run again to continue") from e
            finally:
                if ended == "interrupted":
                    self._wait_quietly()
                sessions.end(state.step, ended)
                self._close_quietly()
        self._report()

    def _batches(self, loop: Loop) -> Iterator[tuple[int, int, Any]]:
        """The loop's positions turned into batches from the data source, one epoch iterator at a time."""
        fetch, fetch_epoch = None, None
        try:
            for epoch, index, indices in loop.run():
                if fetch_epoch != epoch:
                    fetch, fetch_epoch = self.source.epoch(self.sampler, epoch, index), epoch
                self.end_of_epoch = index + 1 == self.sampler.batches_per_epoch
                self.sync_step = (index + 1) % self.accumulate == 0 or self.end_of_epoch
                yield epoch, self.state.step, fetch(indices)
        finally:
            self.source.close()

    def _wait_quietly(self) -> None:
        """Let an in-flight save finish (it is consistent) without raising over another exception."""
        try:
            self._session.writer.wait()
        except SaveFailed as e:
            say(f"warning: the last checkpoint save failed: {e}")

    def _close_quietly(self) -> None:
        self._metrics.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._mirror is not None:
            _flush_mirror(self._mirror, self.options)

    def _report(self) -> None:
        session, state, outcome = self._session, self.state, self.outcome
        if not self.dist.main:
            return
        say(session.writer.stats.summary())
        if outcome is None or outcome.finished:
            say(f"done at step {state.step}; newest checkpoint {session.manager.root / f'step-{state.step:09d}'}")
            return
        if outcome.reason == "save error":
            latest, _ = session.manager.latest_valid()
            say(f"stopped early (a checkpoint could not be written): the newest valid checkpoint is step "
                f"{latest.step if latest else 'none'}. Fix the cause (disk space, I/O errors), then run the same "
                f"command again to continue from it (exit code {EXIT_RESUME})")
        else:
            say(f"stopped early ({outcome.reason}): state committed at step {state.step}. "
                f"Run the same command again to continue (exit code {EXIT_RESUME})")

    def _end_epoch(self, epoch: int) -> dict[str, float]:
        if self.evaluate is None:
            return {}
        return {k: float(v) for k, v in dict(self.evaluate()).items()}

    def _current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _announce_interval(self, interval: float, cost: float) -> None:
        announced = getattr(self, "_announced", None)
        if announced is not None and abs(interval - announced) <= 0.1 * announced:
            return  # only when it changes noticeably
        self._announced = interval
        say(f"--checkpoint-every auto: a save blocks training {cost * 1000:.1f} ms, MTBF {self.options.mtbf} → "
            f"checkpoint every {format_duration(interval)}")


def _device_of(model: torch.nn.Module) -> torch.device:
    parameter = next(iter(model.parameters()), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _flush_mirror(mirror: Mirror, options: RunOptions) -> None:
    """Training never waits on Drive, except here at exit, for at most --drive-flush-timeout."""
    pending = mirror.flush(parse_duration(options.drive_flush_timeout))
    mirror.close()
    if pending:
        say(f"warning: checkpoint(s) {', '.join(map(str, pending))} are committed locally in {mirror.local.root} "
            f"but not yet durable on {mirror.remote.description} after --drive-flush-timeout "
            f"{options.drive_flush_timeout}; keep this machine up and run again, or raise the timeout")
    if mirror.errors:
        say(f"error: {len(mirror.errors)} upload(s) to {mirror.remote.description} failed ({mirror.errors[-1]}); "
            f"those checkpoints exist only in {mirror.local.root}")
    elif mirror.durable:
        say(f"mirrored to {mirror.remote.description}: newest durable checkpoint step {max(mirror.durable)}, "
            f"{mirror.bytes / 1e6:.1f} MB uploaded in {mirror.upload_s:.1f}s")


__all__ = ["IndexBatches", "Run"]
