"""Start-up for ``resumable-train``: decide fresh vs resume, reconcile the config with the checkpoint,
build the MNIST task, and hand off to the loop."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .checkpoint import CheckpointInfo, CheckpointManager, InvalidCheckpoint, checkpoints_dir, describe_age
from .checkpoint.writer import CheckpointWriter, SaveFailed, SaveStats
from .config import COMPUTATION_FIELDS, SESSION_FIELDS, TrainConfig, format_duration, parse_duration
from .errors import ConfigMismatch, NothingToResume, ResumableError, RunDirInUse
from .lock import RunLock
from .loop import Loop, LoopPlan
from .metrics import MetricsLog
from .preemption import EXIT_RESUME, Budget, StopFlag, colab_default_limit_s, process_age_s
from .session import Session
from .state import TrainState
from .storage import RunLocation, StorageError, open_run_location
from .storage.lease import DriveLease
from .storage.tiered import Mirror, restore_newest
from .tasks.mnist_task import MnistTask
from .triggers import SaveTriggers


def say(message: str) -> None:
    print(f"resumable: {message}", file=sys.stderr, flush=True)


@dataclass
class Startup:
    config: TrainConfig
    checkpoint: CheckpointInfo | None = None  # newest valid checkpoint, None = start fresh
    skipped: list[CheckpointInfo] = field(default_factory=list)  # newer ones that failed verification


def resolve_config(explicit: dict[str, Any], saved: dict[str, Any] | None) -> TrainConfig:
    """Options given on the command line win; the rest come from the checkpoint (when resuming) or the
    defaults. A computation field given explicitly must equal the checkpoint's."""
    if saved is None:
        return TrainConfig(**explicit)
    base = {k: v for k, v in TrainConfig.from_dict(saved).to_dict().items() if k not in SESSION_FIELDS}
    for name in COMPUTATION_FIELDS:
        if name in explicit and explicit[name] != base.get(name):
            raise ConfigMismatch(name, base.get(name), explicit[name], explicit.get("run_dir", "?"))
    return TrainConfig(**{**base, **explicit})


def choose_start(explicit: dict[str, Any], mode: str, overwrite: bool, local_dir: Path | None = None) -> Startup:
    """Pick the checkpoint to resume (or none) without modifying anything on disk."""
    run_dir = explicit.get("run_dir", TrainConfig.run_dir)
    manager = CheckpointManager(checkpoints_dir(local_dir or run_dir))
    infos = manager.inspect(deep=False)
    committed = [i for i in infos if i.committed]
    if mode == "fresh":
        if committed and not overwrite:
            raise RunDirInUse(f"{run_dir} already has {len(committed)} checkpoint(s) (newest step "
                              f"{committed[-1].step}); --fresh would discard them. Add --overwrite to delete them, "
                              f"or choose another --run-dir")
        return Startup(TrainConfig(**explicit))
    latest, skipped = manager.latest_valid()  # hashes newest-first, stops at the first valid one
    if latest is None:
        infos = skipped[::-1]
        if mode == "resume":
            found = "; ".join(f"step {i.step}: {i.reason}" for i in infos) or "no checkpoints at all"
            raise NothingToResume(f"--resume needs a valid checkpoint in {checkpoints_dir(run_dir)}, found: {found}. "
                                  f"Run without --resume to start fresh")
        if committed:
            found = "; ".join(f"step {i.step}: {i.reason}" for i in infos if i.committed)
            raise NothingToResume(f"{run_dir} has checkpoints but none is valid ({found}); refusing to start over "
                                  f"on top of them. Use --fresh --overwrite to discard them, or another --run-dir")
        return Startup(TrainConfig(**explicit))
    return Startup(resolve_config(explicit, latest.manifest.get("config")), latest, skipped)


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ResumableError("--device cuda was given but CUDA is not available here; use --device cpu or auto")
    return torch.device(name)


def _check_computation(saved: dict[str, Any], current: dict[str, Any], run_dir: str) -> None:
    for key in sorted(set(saved) | set(current)):
        default = "none" if key == "amp" else None  # checkpoints from before --amp existed
        if saved.get(key, default) != current.get(key, default):
            raise ConfigMismatch(key, saved.get(key, default), current.get(key, default), run_dir)


def _budget(cfg: TrainConfig) -> Budget:
    start = time.monotonic() - process_age_s()
    if cfg.time_limit_s is not None:
        return Budget(cfg.time_limit_s, start=start)
    colab = colab_default_limit_s()
    if colab is not None:
        say(f"Colab detected: stopping cleanly after {format_duration(colab)} (before the 12 h VM limit, "
            f"counted from VM start); pass --time-limit to change it")
        return Budget(colab)
    return Budget(None)


def _triggers(cfg: TrainConfig) -> SaveTriggers:
    if cfg.checkpoint_every == "auto":
        return SaveTriggers(cfg.checkpoint_steps, None, auto_mtbf_s=parse_duration(cfg.mtbf))
    return SaveTriggers(cfg.checkpoint_steps, cfg.checkpoint_every_s)


@dataclass
class TrainResult:
    exit_code: int  # 0 done, 75 stopped early with state committed (run again to continue)
    state: TrainState
    stats: SaveStats


def train(explicit: dict[str, Any], mode: str = "auto", overwrite: bool = False) -> TrainResult:
    """Run ``resumable-train`` with the options the user gave explicitly."""
    location = _open_location(explicit)
    run_dir = location.local_dir
    if location.remote is not None:
        say(f"run dir {explicit['run_dir']} is mirrored from a local cache in {run_dir}")
    if location.remote is not None and not (mode == "fresh" and overwrite):  # overwrite deletes them anyway
        try:
            restore_newest(location.remote, CheckpointManager(checkpoints_dir(run_dir)), run_dir, say)
        except StorageError as e:
            raise ResumableError(f"cannot look for checkpoints on {location.remote.description}: {e}. Nothing "
                                 f"was changed; run again when it is reachable") from e
    startup = choose_start(explicit, mode, overwrite, local_dir=run_dir)
    cfg = startup.config
    manager = CheckpointManager(checkpoints_dir(run_dir))
    device = _pick_device(cfg.device)
    task = MnistTask(cfg, device)
    computation = task.computation()
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    mirror = Mirror(manager, location.remote, run_dir, say) if location.remote is not None else None
    session = Session(manager, task.objects(), TrainState(),
                      meta={"config": cfg.to_dict(), "computation": computation, "device": str(device)},
                      keep=cfg.keep, keep_best=cfg.keep_best,
                      writer=CheckpointWriter(asynchronous=not cfg.sync_checkpoints), before_commit=metrics.sync,
                      after_commit=mirror.submit if mirror is not None else None)
    if startup.checkpoint is not None:
        _resume(session, startup, computation, cfg)
    lock = RunLock(run_dir)
    lease = DriveLease(location.remote) if location.remote is not None else None
    taken_over = lock.acquire()  # before anything in the run dir changes; raises RunDirInUse
    try:
        if lease is not None:
            try:
                taken_over = lease.acquire() or taken_over
            except StorageError as e:
                raise ResumableError(f"cannot take the lease on {location.remote.description}: {e}") from e
        if taken_over:
            say(taken_over)
        try:
            return _run_locked(session, task, cfg, mode, overwrite, location, mirror, metrics)
        finally:
            if lease is not None:
                lease.release()
    finally:
        lock.release()


def _run_locked(session: Session, task: MnistTask, cfg: TrainConfig, mode: str, overwrite: bool,
                location: RunLocation, mirror: Mirror | None, metrics: MetricsLog) -> TrainResult:
    """Everything that modifies the run dir, under its lock."""
    run_dir, manager, state, device = location.local_dir, session.manager, session.state, task.device
    if mode == "fresh" and overwrite:
        manager.delete_all()
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        for folder in location.remote.list_checkpoints() if location.remote is not None else ():
            location.remote.delete_folder(folder)
        if mirror is not None:
            mirror.durable.clear()  # those were just deleted: the new run's steps must all be uploaded
    run_dir.mkdir(parents=True, exist_ok=True)
    manager.cleanup_incomplete()
    metrics.rollback(state.step)

    announced: list[float] = []

    def announce_interval(interval: float, cost: float) -> None:
        if announced and abs(interval - announced[-1]) <= 0.1 * announced[-1]:
            return  # only when it changes noticeably
        announced.append(interval)
        say(f"--checkpoint-every auto: a save blocks training {cost * 1000:.1f} ms, MTBF {cfg.mtbf} → "
            f"checkpoint every {format_duration(interval)}")

    plan = LoopPlan(epochs=cfg.epochs, max_steps=cfg.max_steps, log_every=cfg.log_every, progress=cfg.progress,
                    on_save_error=cfg.on_save_error)
    with StopFlag() as stop:
        loop = Loop(session, task.sampler, plan, metrics, task.train_step, task.end_epoch, task.current_lr,
                    device, triggers=_triggers(cfg), stop=stop, budget=_budget(cfg),
                    on_interval=announce_interval if cfg.checkpoint_every == "auto" else None)
        if loop.finished() and session.resumed_from is not None:
            say(f"run in {run_dir} is already complete at step {state.step} (epoch {state.epoch}); "
                f"raise --epochs or --max-steps to train further")
            return TrainResult(0, state, session.writer.stats)
        say(f"training on {device} with {torch.get_num_threads()} CPU thread(s): step {state.step} → "
            f"{loop.total_steps}, checkpoints in {manager.root}")
        try:
            outcome = loop.run()
        except SaveFailed as e:
            latest, _ = manager.latest_valid()
            where = f"step {latest.step}" if latest else "none"
            raise SaveFailed(f"{e}. The newest valid checkpoint is {where}; fix the cause (disk space, "
                             f"permissions, storage) and run the same command again to continue") from e
        finally:
            metrics.close()
            if mirror is not None:
                _flush_mirror(mirror, cfg)
    say(session.writer.stats.summary())
    if not outcome.finished:
        if outcome.reason == "save error":
            latest, _ = manager.latest_valid()
            say(f"stopped early (a checkpoint could not be written): the newest valid checkpoint is step "
                f"{latest.step if latest else 'none'}. Fix the cause (disk space, I/O errors), then run the same "
                f"command again to continue from it (exit code {EXIT_RESUME})")
        else:
            say(f"stopped early ({outcome.reason}): state committed at step {state.step}. "
                f"Run the same command again to continue (exit code {EXIT_RESUME})")
        return TrainResult(EXIT_RESUME, state, session.writer.stats)
    say(f"done at step {state.step}; newest checkpoint {manager.root / f'step-{state.step:09d}'}")
    return TrainResult(0, state, session.writer.stats)


def _open_location(explicit: dict[str, Any]) -> RunLocation:
    try:
        return open_run_location(explicit.get("run_dir", TrainConfig.run_dir), explicit.get("cache_dir"),
                                 explicit.get("drive_credentials"))
    except (StorageError, ValueError) as e:
        raise ResumableError(str(e)) from e


def _flush_mirror(mirror: Mirror, cfg: TrainConfig) -> None:
    """Training never waits on Drive, except here at exit, for at most --drive-flush-timeout."""
    pending = mirror.flush(parse_duration(cfg.drive_flush_timeout))
    mirror.close()
    if pending:
        say(f"warning: checkpoint(s) {', '.join(map(str, pending))} are committed locally in {mirror.local.root} "
            f"but not yet durable on {mirror.remote.description} after --drive-flush-timeout "
            f"{cfg.drive_flush_timeout}; keep this machine up and run again, or raise the timeout")
    if mirror.errors:
        say(f"error: {len(mirror.errors)} upload(s) to {mirror.remote.description} failed ({mirror.errors[-1]}); "
            f"those checkpoints exist only in {mirror.local.root}")
    elif mirror.durable:
        say(f"mirrored to {mirror.remote.description}: newest durable checkpoint step {max(mirror.durable)}, "
            f"{mirror.bytes / 1e6:.1f} MB uploaded in {mirror.upload_s:.1f}s")


def _candidates(manager: CheckpointManager, startup: Startup) -> Iterator[CheckpointInfo]:
    """The skipped newer directories, the chosen checkpoint, then older ones verified lazily."""
    assert startup.checkpoint is not None
    yield from startup.skipped
    yield startup.checkpoint
    for step, path in reversed(manager.step_dirs()):
        if step < startup.checkpoint.step:
            yield manager.check(step, path, deep=True)


def _resume(session: Session, startup: Startup, computation: dict[str, Any], cfg: TrainConfig) -> None:
    """Restore the newest checkpoint that verifies and loads, warning about each one skipped."""
    for info in _candidates(session.manager, startup):
        if not info.valid:
            say(f"warning: skipping checkpoint step {info.step} ({info.path}): {info.reason}")
            continue
        _check_computation(info.manifest.get("computation", {}), computation, cfg.run_dir)
        threads = info.manifest.get("num_threads")
        if isinstance(threads, int) and threads != torch.get_num_threads():
            say(f"setting torch threads to {threads} (was {torch.get_num_threads()}) as recorded in the "
                f"checkpoint, so CPU results stay bit-identical")
            torch.set_num_threads(threads)
        try:
            session.restore(info)
        except InvalidCheckpoint as e:  # raised before any object is modified
            say(f"warning: skipping checkpoint step {info.step} ({info.path}): {e}")
            continue
        except (RuntimeError, ValueError, KeyError) as e:
            detail = " ".join(str(e).split())  # torch's message spans lines; the error stays one line
            raise ResumableError(f"the checkpoint {info.path} does not fit this model/optimizer ({detail}); use "
                                 f"the matching options, or start over with --fresh --overwrite") from e
        say(f"resuming from step {info.step} (epoch {session.state.epoch}, batch {session.state.batch_in_epoch}), "
            f"saved {describe_age(info.created)}")
        return
    raise ResumableError("no checkpoint could be loaded (see the warnings above); start over with --fresh "
                         "--overwrite or use another --run-dir")
