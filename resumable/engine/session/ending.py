"""How a session ends: the last wait for Drive, and the summary lines that say what state the run is in."""

from __future__ import annotations

import time
from collections.abc import Callable

from ... import log
from ...checkpoint import CheckpointManager
from ...checkpoint.writer import CheckpointWriter
from ...config import format_duration, parse_duration
from ...errors import EXIT_NOT_DURABLE, EXIT_RESUME, ResumableError, StopNow
from ...storage.tiered import Mirror
from ..loop.plan import Outcome
from ..loop.preemption import Budget, StopFlag
from ..state.keeper import StateKeeper
from ..state.train_state import TrainState


def close_mirror(mirror: Mirror, flush_timeout: str, interrupted: bool, budget: Budget | None = None,
                 stop: Callable[[], bool] | None = None) -> bool:
    """Training never waits on Drive, except here at exit, for at most --drive-flush-timeout (not at all
    after a second Ctrl-C: the user wants out now, and what is committed locally goes up next time).

    Returns whether the newest committed checkpoint is *not* durable on the remote now (the session then exits
    EXIT_NOT_DURABLE). Judged by what is there at exit: a pass that failed earlier and was made good later does
    not count. Not judged after a second Ctrl-C or a lost lease (those exit 130 and 75 whatever Drive holds).
    ``stop()`` true (a second interrupt during the wait) ends the wait at once, as ``interrupted`` would have."""
    if interrupted:
        mirror.close(timeout=0)  # stops before its next remote call; the file in flight may still land
        log.warning(f"interrupted: not waiting for uploads to {mirror.remote.description}; checkpoints not yet "
                    f"there are committed in {mirror.local.root} and go up at the next start")
        return False
    lost = mirror.lost()
    if lost is not None:  # another machine owns the run dir now: its session uploads, this one must not
        mirror.close(timeout=0)
        log.warning(f"not uploading to {mirror.remote.description}: {lost}; checkpoints not yet there stay in "
                    f"{mirror.local.root}")
        return False
    pending = mirror.flush(parse_duration(flush_timeout), stop)
    if stop is not None and stop():
        return close_mirror(mirror, flush_timeout, True)
    if not mirror.close(timeout=parse_duration(flush_timeout)):  # nothing goes up once the lease is released
        log.warning(f"an upload to {mirror.remote.description} is still running after --drive-flush-timeout; "
                    f"it stops after its current file")
    if pending:
        log.warning(f"checkpoint(s) {', '.join(map(str, pending))} are committed locally in {mirror.local.root} "
                    f"but not yet durable on {mirror.remote.description} after --drive-flush-timeout "
                    f"{flush_timeout}; keep this machine up and run again, or raise the timeout")
    if budget is not None and budget.deadline is not None:
        report_durable(mirror, budget)
    if mirror.errors:
        log.error(f"{len(mirror.errors)} upload(s) to {mirror.remote.description} failed ({mirror.errors[-1]}); "
                  f"those checkpoints exist only in {mirror.local.root}")
    elif mirror.durable:
        log.info(f"mirrored to {mirror.remote.description}: newest durable checkpoint step {max(mirror.durable)}, "
                 f"{mirror.bytes / 1e6:.1f} MB uploaded in {mirror.upload_s:.1f}s"
                 + (f" ({mirror.reused_bytes / 1e6:.1f} MB of unchanged shards already there, not sent again)"
                    if mirror.reused_bytes else "") + _retried(mirror))
    return _report_durability(mirror)


def _retried(mirror: Mirror) -> str:
    """How many calls to the remote this session retried (rate limits, 5xx, resets, timeouts), if any."""
    policy = getattr(mirror.remote, "policy", None)
    retries = getattr(policy, "retries", 0)
    return f"; {retries} call(s) retried after transient errors" if retries else ""


def _report_durability(mirror: Mirror) -> bool:
    """Say which kept steps are durable on the remote and which only local; True when the newest is only local."""
    durable, only_local = mirror.durability()
    if not durable and not only_local:
        return False
    steps = lambda found: ", ".join(map(str, found)) or "none"  # noqa: E731
    log.info(f"durable on {mirror.remote.description}: steps {steps(durable)}; only local: steps {steps(only_local)}")
    newest = max(durable + only_local)
    if newest in durable:
        return False
    log.error(f"the newest checkpoint, step {newest}, is not durable on {mirror.remote.description}: it exists only "
              f"in {mirror.local.root}, and a VM that goes away takes it along. Run the same command again on this "
              f"machine to upload it (exit code {EXIT_NOT_DURABLE})")
    return True


def report_durable(mirror: Mirror, budget: Budget) -> None:
    """One line: when the newest checkpoint became durable on the remote, against the session's time limit."""
    newest = max(mirror.durable, default=None)
    at = mirror.durable_at(newest) if newest is not None else None
    if newest is None or at is None:
        log.warning(f"no checkpoint of this run is durable on {mirror.remote.description} yet")
        return
    save_s, upload_s = budget.reserved
    left = budget.deadline - at
    reserved = f"(final save {save_s:.1f} s + upload {upload_s:.1f} s reserved)"
    if left >= 0:
        log.info(f"newest checkpoint step {newest} durable on {mirror.remote.description} {left:.1f} s before the "
                 f"time limit {reserved}")
    else:
        log.warning(f"newest checkpoint step {newest} became durable on {mirror.remote.description} {-left:.1f} s "
                    f"after the time limit {reserved}: a VM stopped at the limit would have lost it; lower "
                    f"--time-limit to leave more room")


def summarise(keeper: StateKeeper, state: TrainState, outcome: Outcome | None, lost: str | None,
              run_dir: str) -> None:
    log.summary(keeper.writer.stats.summary())
    if outcome is None or outcome.finished:
        log.summary(f"done at step {state.step}; newest checkpoint "
                    f"{keeper.manager.root / f'step-{state.step:09d}'}")
        return
    if outcome.reason == "save error":
        latest, _ = keeper.manager.latest_valid()
        log.summary(f"stopped early (a checkpoint could not be written): the newest valid checkpoint is step "
                    f"{latest.step if latest else 'none'}. Fix the cause (disk space, I/O errors), then run the "
                    f"same command again to continue from it (exit code {EXIT_RESUME})")
    elif outcome.reason == "save stuck":  # its disk may be dead: nothing is read from it again
        log.summary(f"stopped early: a checkpoint save was stuck (a dead mount or disk?) and was given up; the newest "
                    f"checkpoint committed before it stays valid. Run the same command again once the disk answers "
                    f"(exit code {EXIT_RESUME})")
    elif outcome.reason == "checkpoint missing":
        latest, _ = keeper.manager.latest_valid()
        log.summary(f"stopped: the newest valid checkpoint is {f'step {latest.step}' if latest else 'none'}; run "
                    f"the same command again to continue from it (exit code {EXIT_RESUME})")
    elif outcome.reason == "lock lost":
        log.error(f"stopped: {lost or 'the run dir lock was lost'}; nothing more was written. The other process "
                  f"now owns {run_dir} (exit code {EXIT_RESUME})")
    else:
        log.summary(f"stopped early ({outcome.reason}): state committed at step {state.step}. "
                    f"Run the same command again to continue (exit code {EXIT_RESUME})")


def finish_save(writer: CheckpointWriter, bound: float, stop: StopFlag | None) -> bool:
    """At the end of a session left early: wait for the save in flight (it is consistent and commits) for at most
    ``bound`` seconds, or until a second stop signal (``stop.forced``); give up a save still running then (stuck:
    it never commits, and the newest committed checkpoint stays valid). Returns whether a given-up save's thread is
    still running (a dead disk: it cannot be stopped from Python)."""
    if writer.busy:
        label = writer.label
        deadline = time.monotonic() + bound
        try:
            if stop is not None:
                stop.saving = True  # a second stop signal (it only sets ``forced`` now) gives the save up
            while not writer.wait_idle(min(0.1, max(deadline - time.monotonic(), 0.0))):
                if time.monotonic() >= deadline or (stop is not None and stop.forced):
                    break
        except (KeyboardInterrupt, StopNow):  # raised by other code's handlers: give the save up too
            pass
        finally:
            if stop is not None:
                stop.saving = False
        if writer.busy and writer.abandon():
            log.warning(f"gave up the checkpoint save of {label}, still running" + ("" if bound == 0 else
                        f" after {format_duration(bound)} (stuck on its disk?)") + ": it is not committed, and "
                        "the newest committed checkpoint stays valid")
    try:
        writer.wait()
    except ResumableError as e:
        log.warning(f"the last checkpoint save failed: {e}")
    return writer.abandoned_thread is not None and writer.abandoned_thread.is_alive()


def describe_error(error: BaseException) -> str:
    """How a session that an exception ended is recorded in sessions.jsonl."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if isinstance(error, StopNow):  # a second stop signal during a save: a stop on purpose, not a failure
        return f"{error.signal_name} (at once)"
    return f"error: {type(error).__name__}"


def error_detail(error: BaseException) -> str:
    """An exception's type and message on one line, for the end record (what the crash-loop check quotes)."""
    return " ".join(f"{type(error).__name__}: {error}".split())[:500]


def confirm_committed(outcome: Outcome | None, manager: CheckpointManager, step: int) -> Outcome | None:
    """Before reporting the state committed, read the newest checkpoint back from where it claims to be: a run
    dir deleted or emptied under a live run must not end in "done" with no checkpoint anywhere."""
    if outcome is None or outcome.reason in ("save error", "save stuck", "lock lost"):
        return outcome
    info = manager.check(step, manager.folder(step), deep=False)
    if info.valid:
        return outcome
    log.error(f"the checkpoint of step {step} is not in {manager.root} any more ({info.reason}): was the run dir "
              f"deleted or changed while training? Nothing of this session is committed there")
    return Outcome(False, "checkpoint missing")
