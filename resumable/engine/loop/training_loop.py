"""The resumable epoch/step loop: it only decides. Task code supplies a train step and an end-of-epoch hook;
the loop owns the position in the data, the checkpoint triggers and stopping early, and emits what happened
to its reporters (metrics, TensorBoard, progress, console: see reporting/reporters.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ... import log
from ...config import format_duration
from ...distributed import Distributed, Pending
from ...errors import ResumeNotApplied, SaveFailed, SaveStuck, StateNotLoadable
from ...reporting.reporters import Reporter
from ..data.content_check import first_batch_problem, source_name
from ..data.sampler import ResumableSampler
from ..state.keeper import StateKeeper
from .evaluation import Evaluator
from .plan import Estimate, LoopPlan, Outcome
from .preemption import Budget, StopFlag
from .triggers import SaveTriggers
from .watchdog import Watchdog

STOP_GRACE_S = 10.0  # after a stop is asked for, a save the loop waits for gets this long (or 3x the slowest save)


class Loop:
    """Walks training from ``session.state`` to the end of the plan, checkpointing on the way.

    :meth:`run` is a generator of ``(epoch, batch_index, item, last)`` from ``sampler.walk`` (``item``: the
    batch's dataset indices, or the batch itself for a stream; ``last``: the epoch's last batch): the caller
    trains that (micro-)batch,
    optionally passes its loss to :meth:`report_loss`, then asks for the next. Bookkeeping, logging,
    triggers and saves happen between batches, at optimizer-step boundaries only: with
    ``plan.accumulate = K`` a step is K micro-batches (or the rest of the epoch), so a checkpoint never holds
    half-accumulated gradients. ``evaluate`` (engine/loop/evaluation.py) says when to evaluate (every N steps, at
    an epoch's end) and runs the user's evaluation; each one is followed by a checkpoint that records its metrics.
    ``current_lr()`` is logged with each training record. Before every step the loop checks for a stop
    request (``stop.requested``) and whether the next step and a final save still fit in ``budget``; either
    commits a checkpoint and ends the generator with an unfinished :attr:`outcome`.
    """

    def __init__(self, session: StateKeeper, sampler: ResumableSampler, plan: LoopPlan, report: Reporter,
                 evaluate: Evaluator,
                 current_lr: Callable[[], float], device: torch.device,
                 triggers: SaveTriggers | None = None, stop: StopFlag | None = None,
                 budget: Budget | None = None, on_interval: Callable[[float, float], None] | None = None,
                 dist: Distributed | None = None, lost: Callable[[], str | None] | None = None,
                 watchdog: Watchdog | None = None) -> None:
        self.session = session
        self.state = session.state
        self.sampler = sampler
        self.plan = plan
        self.report = report
        self.evaluate = evaluate
        self.current_lr = current_lr
        self.device = device
        self.triggers = triggers or SaveTriggers(None, None)
        self.stop = stop
        self.budget = budget or Budget(None)
        self.on_interval = on_interval
        self.outcome: Outcome | None = None
        self.dist = dist
        self.lost = lost or (lambda: None)  # why the run dir is no longer ours (lock/lease taken over)
        self._save_error: str | None = None  # set under --on-save-error stop
        self._loss: torch.Tensor | None = None
        self._pending: Pending | None = None  # the step decision issued at the previous boundary (DDP)
        self.step_time = Estimate()
        self.eval_time = Estimate()
        self._clock = time.monotonic()
        self._session_start_step = self.state.step
        self.watchdog = watchdog  # ticked at each step, paused around evaluation, bounding blocking saves
        self._told_waiting = False
        self._stuck = False  # a save was given up as stuck: nothing more is read or written on that disk
        self._fatal: StateNotLoadable | None = None  # a state no commit could ever load: the run ends with it

    def _paused(self) -> contextlib.AbstractContextManager:
        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _saving(self) -> Iterator[None]:
        """The loop blocks on a checkpoint save: watched against the save bound (engine/loop/watchdog.py), and a second
        stop signal stops at once (engine/loop/preemption.py)."""
        watch = self.watchdog.saving() if self.watchdog is not None else contextlib.nullcontext()
        if self.stop is not None:
            self.stop.saving = True
        try:
            with watch:
                yield
        finally:
            if self.stop is not None:
                self.stop.saving = False

    def _waiting(self, waited_s: float) -> None:
        """Called while the loop waits for a save. Once a stop was asked for, the save gets a grace (say so, and how
        to stop at once); a save still running after it is stuck (a dead mount): given up, so that the stop gives
        control back."""
        stop, writer = self.stop, self.session.writer
        if stop is None or not stop.requested:
            return
        grace = max(STOP_GRACE_S, 3 * writer.stats.slowest_s)
        if not self._told_waiting and waited_s >= 1.0:
            self._told_waiting = True
            again = "interrupt again" if stop.requested == "SIGINT" else f"send {stop.requested} again"
            log.warning(f"stopping ({stop.requested}) once the checkpoint of {writer.label} is written (running "
                        f"{waited_s:.0f}s; it is given up after {grace:.0f}s more); {again} to stop at once without "
                        f"it: the newest committed checkpoint stays valid")
        asked = stop.requested_at
        label = writer.label
        since = waited_s if asked is None else min(waited_s, time.monotonic() - asked)  # waited since the stop
        if since > grace and writer.abandon():
            raise SaveStuck(f"the checkpoint of {label} was still being written {grace:.0f}s after the stop was asked "
                            f"for (a dead mount or disk?): given up, it is not committed")

    # -- plan --------------------------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int | None:
        return self.plan.steps_per_epoch(self.sampler)

    @property
    def total_steps(self) -> int | None:
        return self.plan.total_steps(self.sampler)

    def finished(self) -> bool:
        return self.plan.done(self.state)

    def eta_s(self) -> float | None:
        """Seconds to the end of the whole run (all sessions), from this session's step and eval times."""
        if self.step_time.value == 0.0 or self.total_steps is None:
            return None
        left = max(self.total_steps - self.state.step, 0)
        epochs_left = max(self.plan.epochs - self.state.epoch, 0)
        return left * self.step_time.value + epochs_left * self.eval_time.value

    def _stop_reason(self, saving: bool = False) -> str | None:
        """Why training must stop before the next step, if it must. ``saving``: a checkpoint is due at this
        boundary."""
        if self._save_error is not None:
            return "save error"
        if self.lost() is not None:
            return "lock lost"
        if self.stop is not None and self.stop.requested:
            return self.stop.requested
        batches = self.sampler.batches_in(self.state.epoch)  # unknown for a stream: count the evaluation in
        last_of_epoch = batches is None or self.state.batch_in_epoch + self.plan.accumulate >= batches
        step_s = self.step_time.value + (self.eval_time.value if last_of_epoch else 0.0)
        # A checkpoint committed before the next check (due now, or the epoch's end) uploads before the final one.
        saves = 2 if saving or last_of_epoch else 1
        if not self.budget.fits(step_s, self.session.writer.stats.last_total_s, saves=saves):
            return "time limit"
        return None

    def _boundary(self, trigger: str | None, deferred: bool = False) -> tuple[str | None, str | None]:
        """At a step boundary: why training must stop, if it must, and whether a checkpoint is due.

        Under DDP every rank gets the same answer from one all_reduce, so all ranks save and stop at the
        same step: a signal or a spent budget on any rank stops them all, and rank 0's wall-clock trigger
        (or a failed save or a lost lock, which only rank 0 sees) applies everywhere. ``deferred`` (between
        the steps of an epoch): the reduction is started now and its answer used at the next boundary, so
        the host never waits on it (under NCCL a blocking all_reduce would sync the host every step);
        decisions then land one step later, on every rank alike."""
        self._check_saves()  # a failed background save surfaces here, before another step
        reason = self._stop_reason(saving=trigger is not None)
        if self.dist is None or not self.dist.active:
            return reason, trigger
        # A step-count trigger (every N steps, an evaluation's) is the same on every rank without asking; the wall
        # clock is rank 0's.
        by_steps = trigger in ("steps", "evaluation")
        flags = [reason == "save error", reason == "lock lost", self.stop is not None and bool(self.stop.requested),
                 reason == "time limit", trigger is not None and not by_steps]
        previous = self._pending.result() if self._pending is not None else [False] * len(flags)
        self._pending = None
        if previous[4]:  # this boundary saves for the clock's firing at the step before: the clock only
            flags[4] = False  # resets with that save, so its firing now is the same one, not a second save
        if deferred:
            self._pending = self.dist.any_async(flags, self.device)
            agreed = previous
        else:
            agreed = [a or b for a, b in zip(self.dist.any(flags, self.device), previous, strict=True)]
        error, lost, signalled, spent, due = agreed
        reason = None
        if error:
            reason = "save error"
        elif lost:
            reason = "lock lost"
        elif signalled:
            reason = (self.stop.requested if self.stop is not None else None) or "signal on another rank"
        elif spent:
            reason = "time limit"
        return reason, trigger if by_steps else ("time" if due else None)

    def _drain(self) -> None:
        """Finish the deferred decision before other collectives end the session."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def report_loss(self, loss: torch.Tensor) -> None:
        """The loss of the batch just trained (not synced); summed into the epoch's train loss and logged."""
        self._loss = loss

    # -- loop --------------------------------------------------------------------------------------
    def run(self) -> Iterator[tuple[int, int, Any, bool]]:
        self._clock = time.monotonic()
        outcome = Outcome(True, "finished")
        reason = self._boundary(None)[0] if not self.finished() else None
        if reason is not None:
            outcome = Outcome(False, reason)
        while outcome.finished and not self.finished():
            if not self.sampler.epoch_done(self.state.epoch, self.state.batch_in_epoch):
                reason = yield from self._train_epoch()
                if reason is not None:
                    outcome = Outcome(False, reason)
                    break
            if self.sampler.epoch_done(self.state.epoch, self.state.batch_in_epoch):
                self._finish_epoch()
                reason = self._boundary(None)[0] if not self.finished() else None
                if reason is not None:
                    outcome = Outcome(False, reason)
                    break
        self._drain()
        with self._saving():
            self._wait_saves()  # a save still in flight may fail: its outcome decides how this run ends
        if outcome.reason == "lock lost":  # another process owns the run dir now: write nothing more
            self.outcome = outcome
            return
        if not self._failed_anywhere() and self._agree(self.session.last_saved_step != self.state.step):
            self._save(outcome.reason if not outcome.finished else "final")
            with self._saving():
                self._wait_saves(last=True)  # the last save commits before the run ends
        committed = self._save_error is None and self.session.last_saved_step == self.state.step
        if self._agree(not committed):  # the newest state is not committed: never "done", on any rank
            outcome = Outcome(False, "save stuck" if self._stuck else "save error")
        self.outcome = outcome
        if self._fatal is not None:  # the state itself is wrong: an error naming it, not "run again"
            raise self._fatal

    def _check_saves(self) -> None:
        try:
            self.session.writer.check()
        except SaveFailed as e:
            self._save_failed(e)

    def _wait_saves(self, last: bool = False) -> None:
        try:
            self.session.wait_shards()  # every rank's background shard save (a sharded model), then rank 0's writer
            self.session.writer.wait(self._waiting)
        except SaveFailed as e:
            self._save_failed(e, last)

    def _agree(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (so all ranks take the same branch)."""
        if self.dist is None or not self.dist.active:
            return flag
        return self.dist.any([flag], self.device)[0]

    def _failed_anywhere(self) -> bool:
        """Whether a save failed under --on-save-error stop; only rank 0 writes, so it tells the others."""
        if self._agree(self._save_error is not None) and self._save_error is None:
            self._save_error = "a checkpoint save failed on rank 0"
        return self._save_error is not None

    def _save_failed(self, error: SaveFailed, last: bool = False) -> None:
        """Apply --on-save-error: a failed save never counts, the newest valid checkpoint stays.
        ``last``: the run's final save, after which nothing tries again. A stuck save stops in any case, without
        reading the (probably dead) disk again."""
        if isinstance(error, SaveStuck):
            self._save_error, self._stuck = str(error), True
            log.error(f"{error}; the newest committed checkpoint stays valid")
            return
        if isinstance(error.__cause__, StateNotLoadable):  # every later save would fail the same way: stop, and
            self._save_error, self._fatal = str(error.__cause__), error.__cause__  # raise it (run())
            return
        latest, _ = self.session.manager.latest_valid()
        newest = f"step {latest.step}" if latest else "none yet"
        if self.plan.on_save_error == "stop":
            self._save_error = str(error)
            log.error(f"{error}; the newest valid checkpoint is {newest}. Stopping (--on-save-error stop)")
            return
        self.session.last_saved_step = latest.step if latest else None  # so the end of training saves again
        then = ("" if last else " Training goes on and the next save tries again (use --on-save-error stop to stop "
                "instead)")
        log.warning(f"{error}; the newest valid checkpoint is still {newest}.{then}")

    def _train_epoch(self) -> Iterator[tuple[int, int, Any, bool]]:
        """Yield the epoch's batches to the end (or max_steps); returns a stop reason if stopped early."""
        state, plan, sampler = self.state, self.plan, self.sampler
        accumulate = plan.accumulate
        # Summed on the device in float64 and synced only when needed; starting from the saved exact
        # value makes the epoch loss of a resumed run equal to an uninterrupted one.
        loss_sum = torch.tensor(state.epoch_loss_sum, dtype=torch.float64, device=self.device)
        self.report.epoch_begin(state.epoch, plan.epochs)
        rate_clock, rate_samples, step_samples = time.monotonic(), 0, 0
        started = time.monotonic()
        window: list[torch.Tensor] = []
        first = state.batch_in_epoch  # saves happen at step boundaries only, so this starts a window
        for index, item, size, last in sampler.walk(state.epoch, first, self.device):
            if getattr(self.session, "data_next", None) is not None:  # the first batch after a resume, untrained
                self._check_first_batch(state.epoch, index, item)
            if index % accumulate == 0 or index == first:  # a step (accumulation window) begins
                started = time.monotonic()
                step_samples = 0
            self._loss = None
            yield state.epoch, index, item, last
            if self._loss is not None:
                loss = self._loss.detach()
                loss_sum += loss.double()
                window.append(loss)
                state.epoch_loss_count += 1
            state.batch_in_epoch = index + 1
            state.samples_seen += size
            step_samples += size
            if (index + 1) % accumulate and not last:
                continue  # mid-window: no step boundary, so no log, trigger or save here
            state.step += 1
            if self.watchdog is not None:
                self.watchdog.beat(state.step)
            self.session.faults.after_step(state.step)
            rate_samples += step_samples
            record, postfix = None, None
            if state.step % plan.log_every == 0:
                now = time.monotonic()
                rate = rate_samples / max(now - rate_clock, 1e-9)
                record = {"step": state.step, "epoch": state.epoch + 1}
                if window:
                    value = (torch.stack(window).double().mean() if len(window) > 1 else window[0]).item()
                    record["loss"] = value
                    postfix = {"loss": f"{value:.4f}", "samples_s": f"{rate:,.0f}"}
                record.update({"lr": self.current_lr(), "samples_per_s": round(rate, 1), "time": time.time()})
            self.report.step(state.step, record, postfix)
            window = []
            self.step_time.add(time.monotonic() - started)
            # within the epoch (its last step's evaluation comes with the epoch's end, right after)
            within = not last and self.evaluate.due(state.step, epoch_end=False)
            metrics = self._evaluate(within_epoch=True) if within else None
            if plan.max_steps is not None and state.step >= plan.max_steps:
                if metrics is not None:  # the final save is this one: it records the evaluation
                    state.epoch_loss_sum = loss_sum.item()
                    self._save("evaluation", metrics)
                break
            if last:
                break  # the end-of-epoch evaluation, save and stop check come right after
            due = "evaluation" if metrics is not None else self.triggers.due(state.step)
            reason, trigger = self._boundary(due, deferred=True)
            if trigger is not None or reason is not None:
                state.epoch_loss_sum = loss_sum.item()
            if trigger is not None:
                self._save(trigger, metrics)
            if reason is not None:
                return reason
        state.epoch_loss_sum = loss_sum.item()
        return None

    def _check_first_batch(self, epoch: int, index: int, item: Any) -> None:
        """The data produced what the checkpoint recorded it would (engine/data/content_check.py); else
        ResumeNotApplied, before anything is trained. Each rank checks its own data (under torchrun the launcher ends
        the others when one fails: no collective here, as a rank without a record would not join it)."""
        record, self.session.data_next = self.session.data_next, None
        problem = first_batch_problem(record, source_name(self.sampler), epoch, index, item)
        if problem is not None:
            raise ResumeNotApplied(problem)

    def _evaluate(self, within_epoch: bool = False) -> dict[str, float]:
        """Run the evaluation now (the hang watchdog paused) and note the best; one ``within_epoch`` is reported here
        (an epoch's end reports its evaluation with the epoch's record)."""
        state = self.state
        started = time.monotonic()
        with self._paused():
            results = self.evaluate()
        self.eval_time.add(time.monotonic() - started)
        self.evaluate.record_best(state, results)
        if not within_epoch:
            return results
        self._tick()
        record = {"step": state.step, "epoch": state.epoch + 1, **results, "elapsed_s": round(state.elapsed_s, 3),
                  "time": time.time()}
        self.report.summary(record, f"step {state.step} (epoch {state.epoch + 1})"
                            + "".join(f"  {k} {v:.4f}" for k, v in results.items()))
        return results

    def _finish_epoch(self) -> None:
        state = self.state
        results = self._evaluate() if self.evaluate.due(state.step, epoch_end=True) else {}
        self._drain()
        loss_sum, loss_count = state.epoch_loss_sum, state.epoch_loss_count
        if self.dist is not None and self.dist.active:  # the epoch's train loss over every rank's batches
            loss_sum, loss_count = self.dist.sum([loss_sum, float(loss_count)], self.device)
        train_loss = loss_sum / max(loss_count, 1)
        self._tick()
        record = {"step": state.step, "epoch": state.epoch + 1, "train_loss": train_loss, **results,
                  "elapsed_s": round(state.elapsed_s, 3), "time": time.time()}
        eta = self.eta_s()
        total = self.total_steps
        progress = (f"  run {100 * state.step / max(total, 1):.0f}% (step {state.step}/{total}"
                    f"{', ETA ' + format_duration(eta) if eta is not None else ''})" if total is not None else "")
        summary = (f"epoch {state.epoch + 1}/{self.plan.epochs}  step {state.step}  train_loss {train_loss:.4f}"
                   + "".join(f"  {k} {v:.4f}" for k, v in results.items())
                   + f"  trained {format_duration(state.elapsed_s)} in all" + progress)
        self.report.summary(record, summary)
        state.epoch += 1
        state.batch_in_epoch = 0
        state.epoch_loss_sum = 0.0
        state.epoch_loss_count = 0
        self._save("epoch", metrics=results)

    def _tick(self) -> None:
        now = time.monotonic()
        self.state.elapsed_s += now - self._clock
        self._clock = now

    def _save(self, reason: str, metrics: dict[str, float] | None = None) -> None:
        with self._saving():
            self._save_now(reason, metrics)

    def _save_now(self, reason: str, metrics: dict[str, float] | None) -> None:
        self._tick()
        blocked_since = time.perf_counter()
        # This save waits for the one in flight anyway; waiting first lets its failure be handled (warn:
        # reported and cleared; stop: no more saves) before the ranks enter this save's collectives together.
        self._wait_saves()
        if self._failed_anywhere():
            return
        try:
            self.session.save(reason, metrics, blocked_since=blocked_since)
        except SaveFailed as e:  # this save itself, when saving synchronously
            self._save_failed(e)
        stats = self.session.writer.stats
        interval = self.triggers.saved(stats.last_blocked_s)
        if interval is not None and self.on_interval is not None:
            self.on_interval(interval, stats.last_blocked_s)
