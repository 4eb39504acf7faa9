"""One session of a :class:`~resumable.engine.run.Run`: from opening its run dir to the end of its loop.

The Run holds what the user gave (model, optimizer, data, options); a TrainingSession is what one ``for ... in run``
does with it: open the run dir (lock, lease, Drive restore, choice of checkpoint), build the state keeper and load
the chosen checkpoint on every rank, train through the loop (triggers, budget, signals, watchdog), and record how the
session ended, whether the loop finished, was left by ``break`` or an exception, or was closed. The Run asks it for
the results (``outcome``, ``resumed_from``...) and hands it the notebook's events (``close``, ``amend_end``,
``cell_ended``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ... import log
from ...checkpoint import CheckpointManager, checkpoints_dir
from ...checkpoint.sharded import ShardedFormat
from ...checkpoint.writer import CheckpointWriter
from ...config import DURATION_MAX_S
from ...errors import EXIT_RESUME, Hung, StopNow
from ...reporting.history import SessionLog
from ...reporting.metrics import METRICS, MetricsLog
from ...reporting.reporters import Reporters
from ...storage.tiered import Mirror
from ..data.more_sources import PREFIX
from ..loop.evaluation import Evaluator
from ..loop.plan import LoopPlan, Outcome
from ..loop.preemption import Budget, StopFlag, session_budget
from ..loop.torchrun_stop import planned_stop_before_restart, record_planned_stop
from ..loop.training_loop import Loop
from ..loop.triggers import interval_notice, save_triggers
from ..loop.watchdog import Watchdog, start_watchdog
from ..rundir.run_dir import Choice, RunDir
from ..state import determinism, hardware, preflight
from ..state.keeper import StateKeeper
from ..state.verify import TrainingWatch
from . import fresh_start, identity, notebook, open_runs
from .ending import close_mirror, confirm_committed, describe_error, error_detail, finish_save, summarise
from .reports import reporters, started, tracker_ids
from .resume import Expected, resume, start


class TrainingSession:
    """One session of ``run`` (see the module docstring); :meth:`batches` is the generator its loop iterates."""

    def __init__(self, run: Any, loop_file: str | None) -> None:
        self.run = run
        self._loop_file = loop_file  # the file that iterates the Run (engine/session/identity.py)
        self.outcome: Outcome | None = None
        self.resumed_from: int | None = None
        self.data_change: tuple[int, int] | None = None  # (checkpoint's, now) when the dataset changed size
        self.not_durable = False  # the newest committed checkpoint did not reach Drive by the end (exit 74)
        self.elastic_stop = False  # stopped on purpose under torchelastic (see engine/loop/torchrun_stop.py)
        self.sync_step = True  # this micro-batch completes an optimizer step (see accumulate)
        self.end_of_epoch = False  # this batch is the epoch's last (step a per-epoch scheduler here)
        self.keeper: StateKeeper | None = None
        self.loop: Loop | None = None
        self.sessions: SessionLog | None = None
        self.stop_flag: StopFlag | None = None
        self._rundir: RunDir | None = None
        self._mirror: Mirror | None = None
        self._ended_by: str | None = None  # the exception that ended the loop from outside, if any
        self._error: str | None = None  # its type and message
        self._left_at: tuple[int, int] | None = None  # where the loop was left (engine/session/open_runs.py)
        self._iterator: Any = None

    @property
    def finished(self) -> bool:
        return self.outcome is not None and self.outcome.finished

    def batches(self) -> Iterator[tuple[int, int, Any]]:
        generator = self._run()
        # Only the loop holds the generator: a loop left by break or an exception drops it, and CPython finalises
        # it at once, which ends the session there (engine/session/open_runs.py), instead of leaving its watchdog armed.
        self._iterator = weakref.ref(generator)
        return generator

    # -- the notebook's events (engine/session/open_runs.py) ------------------------------------------------------
    def close(self, error: BaseException | None, reason: str) -> None:
        """Run.close: end the loop if it is open (recording ``error`` or ``reason`` as how it ended)."""
        generator = self._iterator() if self._iterator is not None else None
        if generator is not None and generator.gi_frame is not None and not generator.gi_running:
            if self._ended_by is None:
                self._ended_by = describe_error(error) if error is not None else reason
                if error is not None and not isinstance(error, KeyboardInterrupt):
                    self._error = error_detail(error)
            generator.close()
        elif error is not None:
            self.amend_end(error)

    def amend_end(self, error: BaseException) -> bool:
        """Run.amend_end: ``error`` unwound past the loop after it was left: record it as how the session ended."""
        left, self._left_at = self._left_at, None
        if left is None or self.sessions is None or not open_runs.unwound(error, left):
            self._left_at = left
            return False
        detail = None if isinstance(error, KeyboardInterrupt) else error_detail(error)
        return self.sessions.amend(self.run.state.step, "break", describe_error(error), detail)

    def cell_ended(self) -> None:
        """Run.cell_ended: control is outside the loop, so its hang watchdog waits for the next step."""
        if self.loop is not None and self.loop.watchdog is not None:
            self.loop.watchdog.idle()
        if self.stop_flag is not None:
            self.stop_flag.suspend()  # Ctrl-C in other cells is theirs again

    # -- the session ------------------------------------------------------------------------------------------------
    def _run(self) -> Iterator[tuple[int, int, Any]]:
        run = self.run
        if run.faults.describe():  # never silent: they change what the run does
            log.warning(f"faults injected on purpose ({run.faults.describe()}): a chaos test, not a normal run")
        run._close_previous()  # before choosing: its last save may still commit
        open_runs.wait_for_stuck_save(run.run_dir)
        preflight.check_cuda(run.device)  # a GPU that fails its first operation: exit 2 before anything is loaded
        self._identity = (identity.code_digest([run._built_in, self._loop_file, identity.class_file(run.model)]),
                          identity.config_digest(run.settings))
        if run._prepared is not None:
            rundir, choice = run._prepared
            self._identity = rundir.identity or self._identity  # the one its crash-loop check used
        else:
            rundir, choice = RunDir.open(run.dist, run.run_dir, run.options.cache_dir,
                                         run.options.drive_credentials, run.mode, run.overwrite, run.resume_from,
                                         run.ignore_crash_loop or run.faults.ignore_crash_loop, self._identity)
        self._rundir = rundir
        open_runs.add(run.run_dir, run)
        try:
            with log.quiet(run.options.quiet):
                self._restore(rundir, choice)
                yield from self._train(rundir, choice)
        finally:
            open_runs.remove(run.run_dir, run)
            rundir.release()

    def _restore(self, rundir: RunDir, choice: Choice) -> None:
        """Build the keeper and load the chosen checkpoint on every rank (they fail together)."""
        run = self.run
        main = run.dist.main
        if main:
            rundir.local.mkdir(parents=True, exist_ok=True)
        if main and rundir.remote is not None:
            # Once another machine took the lease over, its session owns the remote: this mirror stops at once.
            self._mirror = Mirror(rundir.manager, rundir.remote, rundir.local, log.info, run_id=choice.run_id,
                                  lost=lambda: rundir.lost, after_upload=self._after_upload)
        self._metrics = MetricsLog(rundir.local / METRICS if main else None)
        switch = run.amp_switch
        # where this session trains (engine/state/hardware.py): recorded in each manifest, compared at a resume
        where = {**hardware.describe(run.device), **({"amp_dtype": run.amp} if run.amp is not None else {})}
        self.keeper = StateKeeper(
            CheckpointManager(checkpoints_dir(rundir.local), ShardedFormat(
                run.options.shard_size_bytes, faults=run.faults,
                share_limit=run.options.keep - 1 if run.options.keep >= 2 else None), run.faults),
            run._objects, run.state,
            meta={"config": run.settings, "computation": run.computation, "device": str(run.device),
                  "world_size": run.dist.world_size, "run_id": choice.run_id,
                  "best": {"monitor": run.best.monitor, "mode": run.best.mode}, **self._tracking(choice), **where},
            keep=run.options.keep, keep_best=run.options.keep_best, best=run.best,
            writer=CheckpointWriter(asynchronous=not run.options.sync_checkpoints),
            before_commit=lambda: self._report.before_commit(),
            after_commit=self._after_commit, dist=run.dist,
            faults=run.faults, modules=run._objects["model"], store_frozen=run.options.store_frozen,
            staging_memory=run.options.staging_memory_bytes,
            protect=self._mirror.protected if self._mirror is not None else None,
            fresh=frozenset({"scaler"}) if switch else frozenset())  # a GradScaler the checkpoint lacks starts fresh
        for setting in determinism.set_cheap_defaults():  # before the checkpoint's settings are compared
            if run.device.type == "cuda":  # set on every device (it is recorded), said only where cuBLAS runs
                log.info(f"set {setting} for deterministic cuBLAS (see docs/resuming.md: bit-identical)")
        expected = Expected(run.computation, run.run_dir, run._api, run.allow_data_change, switch)
        resumed = resume(self.keeper, choice, expected, run.sampler, run.dist)
        self.resumed_from, self.data_change = resumed.step, resumed.data_change
        start(run.run_dir, {name: (run._given.get(name), obj) for name, obj in run._objects.items()
                             if name != "sampler"}, run.model, resumed)

    def _evaluator(self) -> Evaluator:
        run, evaluation = self.run, self.run.evaluation
        if evaluation is None:
            return Evaluator(None, run.model)
        return Evaluator(evaluation.fn, run.model, evaluation.every_steps, evaluation.at_epoch_end, run.best)

    def _after_upload(self) -> None:
        """The Drive mirror finished an upload (on its thread): a step retention kept for it may go now."""
        if self.keeper is not None:
            self.keeper.prune()

    def _after_commit(self, step: int) -> None:
        """A checkpoint committed (on the writer's thread): this run's fresh start is on disk now, and Drive gets it."""
        run = self.run
        fresh_start.forget(run.run_dir)
        if self._mirror is not None:
            self._mirror.submit(step)

    def _tracking(self, choice: Choice) -> dict[str, Any]:
        """The tracker run ids for the manifests (engine/session/reports.py): never blocking a resume."""
        run = self.run
        manifest = choice.latest.manifest if choice.latest is not None else None
        self._tracker_ids = tracker_ids(manifest, run._trackers, Path(str(run.run_dir)))
        return dict(self._tracker_ids)

    def _reporters(self, rundir: RunDir) -> Reporters:
        run = self.run
        self.sessions = SessionLog(rundir.local if run.dist.main else None)
        note = (f"dataset changed from {self.data_change[0]} to {self.data_change[1]} samples (allow_data_change)"
                if self.data_change else None)
        history = {"device": hardware.label(self.keeper.meta),
                   **({"amp_switch": run.amp_switch} if run.amp_switch else {}),
                   "code": self._identity[0], "config": self._identity[1]}
        return reporters(run.options, rundir.local, run.dist.main, self._metrics, self.sessions, run._trackers,
                         self._tracker_ids, run.settings, history, note)

    def _train(self, rundir: RunDir, choice: Choice) -> Iterator[tuple[int, int, Any]]:
        """Everything that modifies the run dir (rank 0 holds its lock)."""
        run = self.run
        keeper, state, main = self.keeper, run.state, run.dist.main
        manager = keeper.manager
        stopped = planned_stop_before_restart(run.dist, rundir.local)
        if stopped is not None:  # torchrun restarted the group after a crash, but this job had stopped on purpose
            log.info(f"this torchrun job stopped on purpose at step {stopped.step} ({stopped.reason}) before the "
                     f"group was restarted: not training again. Run the same command again to continue")
            self.outcome, self.elastic_stop = Outcome(False, stopped.reason), True
            return
        if run.mode == "fresh" and run.overwrite and main:
            rundir.reset()
            if self._mirror is not None:
                self._mirror.durable.clear()  # those were just deleted: the new run's steps must all be uploaded
        if main:
            manager.cleanup_incomplete()
            try:
                self._metrics.rollback(state.step)
            except OSError as e:  # a log that cannot be rewritten must not stop training
                log.warning(f"could not roll {METRICS} back to step {state.step} ({e}); it may hold records of "
                            f"the steps after the checkpoint twice")
        self._report = report = self._reporters(rundir)
        plan = LoopPlan(epochs=run.options.epochs, max_steps=run.options.max_steps,
                        log_every=run.options.log_every, on_save_error=run.options.on_save_error,
                        accumulate=run.accumulate)
        ended, interrupted = "interrupted", False  # the loop was left by break, an exception or close()
        with StopFlag() as stop:
            self.stop_flag = stop
            # with Drive, the final checkpoint must be durable there before the limit, not only on this disk
            budget = session_budget(run.options, self._mirror.pace.durable_s if self._mirror is not None else None)
            if plan.done(state) and self.resumed_from is not None:
                log.summary(f"run in {run.run_dir} is already complete at step {state.step} (epoch {state.epoch}); "
                            f"raise epochs or max_steps to train further")
                self.outcome = Outcome(True, "finished")
                keeper.release()
                self._close_mirror(False, budget)
                return
            ranks = f" (rank {run.dist.rank} of {run.dist.world_size})" if run.dist.active else ""
            total = plan.total_steps(run.sampler)
            log.info(f"training on {run.device}{ranks} with {torch.get_num_threads()} CPU thread(s): step "
                     f"{state.step} → {total or 'the end of the data'}, checkpoints in {manager.root}",
                     all_ranks=True)
            if callable(getattr(run.sampler, "describe", None)):  # the user's own sampler: how it is resumed
                log.info(run.sampler.describe())
            report.session_start(state.step, total, self.resumed_from)  # numbers the session: the watchdog's files
            keeper.meta.update(started(report))  # a new MLflow run's id, in the manifests from the first save on
            optimizer = run.optimizer
            loop = Loop(keeper, run.sampler, plan, report, self._evaluator(),
                        lambda: optimizer.param_groups[0]["lr"], run.device, triggers=save_triggers(run.options),
                        stop=stop, budget=budget, on_interval=interval_notice(run.options), dist=run.dist,
                        lost=(lambda: rundir.lost) if main else None, watchdog=self._watch(rundir, state.step))
            self.loop = loop
            completed, hung = False, False
            try:
                yield from self._batches(loop)
                keeper.release()
                self.outcome = confirm_committed(loop.outcome, manager, state.step) if main else loop.outcome
                ended = loop.outcome.reason if loop.outcome is not None else ended
                completed = True
            except (KeyboardInterrupt, StopNow) as e:  # a second Ctrl-C (or stop signal during a save): stop now
                interrupted, ended = True, describe_error(e)
                raise
            except Hung:  # the watchdog found the loop hung (a notebook) and has recorded the session's end
                hung = True
                raise
            except GeneratorExit:
                if self._ended_by is None:  # finalised: the loop was left (break, or an exception unwinding past it)
                    ended = "interrupted (Ctrl-C)" if stop.forced else "break"
                    self._left_at = open_runs.loop_position()
                    open_runs.left(run)  # the exception, if one left it, is reported next (session/open_runs.py)
                else:  # closed: by close(), ``with run:``, or a new Run on this run dir
                    ended = self._ended_by
                if self._error:
                    self.sessions.note_error(self._error)
                raise
            except Exception as e:  # raised inside the engine (evaluate(), a fault): recorded for the crash-loop check
                ended = describe_error(e)
                self.sessions.note_error(error_detail(e))
                raise
            finally:
                stop.armed = False  # from here on nothing is raised in this thread on the watchdog's behalf
                saving_hung = loop.watchdog is not None and loop.watchdog.hung_on == "save"
                if loop.watchdog is not None:
                    loop.watchdog.stop()  # the final uploads are not watched
                if not completed:
                    self._wait_quietly(at_once=stop.forced or hung and saving_hung)
                report.session_end(state.step, ended)
                self._close_mirror(interrupted or stop.forced or hung, budget)
        self._summarise()
        if not self.finished and record_planned_stop(run.dist, rundir.local, self.outcome.reason, state.step):
            # torchrun counts exit 75 as a failure and would restart the group (training on, past the stop, with
            # a fresh budget); exit 0 ends it, and `resumable torchrun` reads the marker and exits 75
            self.elastic_stop = True
            log.info(f"under torchrun this worker exits 0, so that the group is not restarted; `resumable torchrun` "
                     f"exits {EXIT_RESUME} for this stop (plain torchrun exits 0)")

    def _watch(self, rundir: RunDir, step: int) -> Watchdog | None:
        """Arm the step watchdog (engine/loop/watchdog.py); every rank runs its own and writes its own stack file."""
        run = self.run
        if not run.options.watchdog_on:
            return None
        session = run.dist.broadcast(self.sessions.number)  # rank 0 numbers the sessions: one name on every rank
        stats = self.keeper.writer.stats
        # In a notebook the process is the user's kernel: a hang raises in the training thread instead of exiting.
        interrupt = self.stop_flag.interrupt if notebook.interactive() and self.stop_flag is not None else None
        return start_watchdog(run.options.hang_timeout, run.options.hang_timeout_s, rundir.local, run.dist.rank,
                              session, step, self.sessions.end if run.dist.main else None,
                              self.keeper.writer.wait_idle, slowest_save=lambda: stats.slowest_s,
                              interrupt=interrupt)

    def _batches(self, loop: Loop) -> Iterator[tuple[int, int, Any]]:
        """The loop's positions turned into batches from the data source, one epoch iterator at a time."""
        run = self.run
        fetch, fetch_epoch = None, None
        watch = TrainingWatch([o for o in run._objects.values() if hasattr(o, "param_groups")], run._objects["model"])
        try:
            for epoch, index, item, last in loop.run():
                if fetch_epoch != epoch:
                    fetch, fetch_epoch = run.source.epoch(run.sampler, epoch, index), epoch
                self.end_of_epoch = last
                self.sync_step = (index + 1) % run.accumulate == 0 or last
                batch = fetch(item)
                watch.begin()
                yield epoch, run.state.step, batch
                if loop.watchdog is not None:
                    loop.watchdog.wake()  # a notebook cell that left the loop suspended made it idle
                if self.stop_flag is not None:
                    self.stop_flag.resume()  # ... and gave the signals back
                if self.sync_step:  # an optimizer step is done: it stepped the Run's objects, or stop here
                    watch.check()
        finally:
            watch.close()
            run.source.close()
            for name, obj in run._objects.items():  # the sources of run.loader(...): their workers end too
                if name.startswith(PREFIX):
                    obj.close()

    def _wait_quietly(self, at_once: bool = False) -> None:
        """Let an in-flight save finish (it is consistent) without raising over another exception; give it up when
        it is stuck (ending.finish_save), at once after a second interrupt or when the watchdog found it hung."""
        run = self.run
        writer = self.keeper.writer
        watchdog = self.loop.watchdog if self.loop is not None else None
        bound = 0.0 if at_once else watchdog.save_limit() if watchdog is not None else DURATION_MAX_S
        if finish_save(writer, bound, self.stop_flag):
            open_runs.stuck(run.run_dir, writer)  # a new session on this run dir waits for it first

    def _close_mirror(self, interrupted: bool, budget: Budget) -> None:
        run = self.run
        if self._mirror is not None:
            stop = self.stop_flag
            self.not_durable = close_mirror(self._mirror, run.options.drive_flush_timeout, interrupted, budget,
                                             (lambda: stop.forced) if stop is not None else None)

    def _summarise(self) -> None:
        run = self.run
        summarise(self.keeper, run.state, self.outcome, self._rundir.lost if self._rundir else None,
                  run.run_dir)
