"""The public API: make your own training loop resumable.

::

    run = resumable.Run("runs/mine", model=model, optimizer=optimizer, scheduler=scheduler,
                        data=train_set, batch_size=64, epochs=10, evaluate=evaluate,
                        loader=resumable.Loader(num_workers=2))
    for epoch, step, (x, y) in run:          # resumes from the newest valid checkpoint, if any
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        run.log(loss)

A :class:`Run` is the same engine ``resumable-train`` uses. It is a facade over the parts that do the work:
the run dir (engine/rundir/run_dir.py: location, lock, Drive restore, choice of checkpoint), the state keeper
(engine/state/keeper.py: what goes into a checkpoint and back), the loop (engine/loop/training_loop.py: steps, epochs,
saves, stops) and the reporters (reporting/: metrics, TensorBoard, progress, session history). After the loop,
``run.finished`` says whether training is complete; otherwise it stopped early with its state committed, and running the
same code again continues.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .. import log
from ..checkpoint import CheckpointManager, checkpoints_dir, describe_age
from ..checkpoint.sharded import ShardedFormat
from ..checkpoint.writer import CheckpointWriter, SaveStats
from ..config import DURATION_MAX_S, format_duration
from ..distributed import Distributed
from ..errors import EXIT_NOT_DURABLE, EXIT_RESUME, Hung, ResumableError, StopNow
from ..faults import Faults
from ..faults import installed as installed_faults
from ..policies import Checkpointing, Loader, Location, Reporting, Session, location_of, to_options
from ..reporting.history import SessionLog
from ..reporting.metrics import METRICS, MetricsLog
from ..reporting.reporters import (
    ConsoleReporter,
    HistoryReporter,
    MetricsReporter,
    ProgressReporter,
    Reporter,
    Reporters,
    TensorBoardReporter,
)
from ..reporting.tensorboard import TensorBoardLog
from ..reporting.wandb import WANDB_ID, WandbReporter, choose_id, require_wandb
from ..storage.tiered import Mirror
from .arguments import as_source, budget, device_of, json_value, plain_module, triggers
from .data.remap import accept_data_change, remap_position
from .data.sources import IndexBatches
from .loop.preemption import StopFlag
from .loop.torchrun_stop import planned_stop_before_restart, record_planned_stop
from .loop.training_loop import Loop, LoopPlan, Outcome
from .loop.watchdog import Watchdog, start_watchdog
from .rundir.run_dir import Choice, RunDir
from .session import fresh_start, identity, notebook, open_runs
from .session.ending import close_mirror, confirm_committed, describe_error, error_detail, finish_save, summarise
from .state import determinism, hardware
from .state.keeper import StateKeeper
from .state.train_state import Stateful, TrainState, as_stateful
from .state.verify import TrainingWatch, check_schedulers

_BUILT_IN = ("model", "optimizer", "scheduler", "scaler", "sampler")


def tracker_of(tracker: Any, project: str | None) -> Any:
    """``tracker`` checked: None (W&B on when a ``wandb`` project is given), ``"wandb"`` or a W&B run object."""
    if tracker is None and project is not None:
        tracker = "wandb"
    if tracker == "wandb":
        require_wandb()  # exit 2 with the fix before anything starts
    elif tracker is not None and not (callable(getattr(tracker, "log", None)) and hasattr(tracker, "id")):
        raise ValueError(f"tracker={tracker!r} must be 'wandb' or a W&B run (wandb.init(...)); None for none")
    return tracker


@dataclass(frozen=True)
class ToolHooks:
    """What tools built on the engine change about a Run (see :meth:`Run._for_tool`); not for training scripts."""

    computation: Mapping[str, Any] | None = None
    settings: Mapping[str, Any] | None = None
    prepared: tuple[RunDir, Choice] | None = None
    faults: Faults | None = None
    amp_switch: Mapping[str, Any] | None = None


class Run:
    """A resumable training run over ``data`` (see the module docstring for the loop).

    Iterating yields ``(epoch, step, batch)``: ``epoch`` counts from 0 and ``step`` is the number of optimizer
    steps done before this batch (so it is also the 0-based index of the step the batch belongs to).

    ``data`` is a map-style ``Dataset`` (loaded through a ``DataLoader``: ``loader=Loader(num_workers=2, ...)``),
    :class:`resumable.IndexBatches` for tensors already on the device, or iterable data (an ``IterableDataset``, e.g.
    Hugging Face ``datasets`` streaming, or a loader such as torchdata's ``StatefulDataLoader``; an epoch ends when
    it is exhausted: see engine/data/stream.py). ``evaluate()`` runs after each epoch and returns metrics
    (``test_acc`` picks the best checkpoint); the model's train/eval modes are restored after it. ``objects`` adds
    more ``Stateful`` things to checkpoint (an EMA, a custom sampler, a ``torch``/``numpy``/``random``
    generator...). ``accumulate=K`` makes a step K micro-batches: call ``optimizer.step()`` when ``run.sync_step``
    is true; checkpoints are only taken between steps. ``config`` (JSON-able) is recorded and must match on resume.
    ``amp`` (none, bf16, fp16) is the autocast dtype the loop uses, recorded in each manifest as ``amp_dtype``.
    ``tracker="wandb"`` (or ``Reporting(wandb="project")``) logs the records to one Weights & Biases run across
    sessions; a W&B run object is logged to as it is (reporting/wandb.py).

    The policies (resumable/policies.py), each optional: ``run_dir`` is a path or a :class:`Location` (a Drive
    run dir's cache and credentials); ``loader=Loader(...)`` how a map-style dataset is loaded;
    ``checkpointing=Checkpointing(every="5m", steps=None, keep=3, ...)`` when to save and what to keep;
    ``session=Session(resume="auto", max_steps=None, time_limit=None, hang_timeout="auto", ...)`` how this session
    starts and when it stops; ``reporting=Reporting(progress=True, ...)`` what is printed and logged.
    """

    def __init__(self, run_dir: str | Path | Location, *, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, data: Any, batch_size: int, epochs: int = 1, seed: int = 0,
                 scheduler: Stateful | None = None, scaler: Stateful | None = None,
                 objects: Mapping[str, Any] | None = None,
                 evaluate: Callable[[], Mapping[str, float]] | None = None, accumulate: int = 1,
                 config: Mapping[str, Any] | None = None, device: torch.device | str | None = None,
                 amp: str | None = None, tracker: Any = None, loader: Loader | None = None,
                 checkpointing: Checkpointing | None = None, session: Session | None = None,
                 reporting: Reporting | None = None) -> None:
        if accumulate < 1:
            raise ValueError(f"accumulate={accumulate} must be at least 1")
        location = location_of(run_dir)
        loader, session = loader or Loader(), session or Session()
        self.run_dir = location.path
        self.options = to_options(epochs, location, checkpointing or Checkpointing(), session,
                                  reporting or Reporting())
        self._tracker = tracker_of(tracker, self.options.wandb)  # None, "wandb" or a W&B run object
        self.model = model
        self.optimizer = optimizer
        self.dist = Distributed.current()  # torchrun: the user (or resumable-train) initialised the group
        log.set_rank(self.dist.rank)
        self.source, self.sampler, size = as_source(data, loader.loader_options(), batch_size, seed, loader.shuffle,
                                                    loader.drop_last, self.dist)
        self.sampler.allow_size_change = self.allow_data_change = session.allow_data_change
        self.data_change: tuple[int, int] | None = None  # (checkpoint's, now) when the dataset changed size
        self.accumulate = accumulate
        self.evaluate = evaluate
        self.device = torch.device(device) if device is not None else device_of(model)
        self.faults = installed_faults()  # none, or those chaos's child bootstrap installed
        self._objects: dict[str, Stateful | None] = {"model": plain_module(model), "optimizer": optimizer,
                                                     "scheduler": scheduler, "scaler": scaler,
                                                     "sampler": self.sampler}
        # as the user passed them: what a later fresh start in this process compares (engine/session/fresh_start.py)
        self._given: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                                       "scaler": scaler, **(objects or {})}
        for name, obj in (objects or {}).items():
            if name in _BUILT_IN:
                raise ValueError(f"objects={{{name!r}: ...}} clashes with a built-in checkpoint entry; rename it")
            self._objects[name] = as_stateful(name, obj)
        computation = {"batch_size": batch_size, "seed": seed, "accumulate": accumulate, "num_samples": size,
                       "shuffle": loader.shuffle, "drop_last": loader.drop_last,
                       "config": dict(config) if config is not None else None}
        # What a checkpoint must match to be resumed, as JSON will give it back.
        self.computation: dict[str, Any] = json_value(computation, "config" if config else "computation")
        # Recorded in every manifest: the options of the run.
        self.settings: dict[str, Any] = json_value({**asdict(self.options), **self.computation}, "settings")
        self._api = True  # messages for API users, not CLI options
        self.mode = {"auto": "auto", "must": "resume", "never": "fresh"}[session.resume]
        self.overwrite = session.overwrite
        self.state = TrainState()
        self.outcome: Outcome | None = None
        self._not_durable = False  # the newest committed checkpoint did not reach Drive by the end (exit 74)
        self.sync_step = True  # this micro-batch completes an optimizer step (see accumulate)
        self.end_of_epoch = False  # this batch is the epoch's last (step a per-epoch scheduler here)
        self.resumed_from: int | None = None
        self._prepared: tuple[RunDir, Choice] | None = None
        self._rundir: RunDir | None = None
        self._keeper: StateKeeper | None = None
        self._mirror: Mirror | None = None
        self._loop: Loop | None = None
        self._iterator: Iterator[tuple[int, int, Any]] | None = None
        self._elastic_stop = False  # stopped on purpose under torchelastic (see engine/loop/torchrun_stop.py)
        self._ended_by: str | None = None  # the exception that ended the loop from outside, if any
        self._error: str | None = None  # its type and message
        self.resume_from, self.ignore_crash_loop = session.resume_from, session.ignore_crash_loop
        self.amp, self.amp_switch = amp, None
        self._built_in = identity.caller_file(sys._getframe(1))  # the script or notebook cell that built it
        self._loop_file: str | None = None  # ... and the one that iterates it (see engine/session/identity.py)
        self._iterated = False
        self._left_at: tuple[int, int] | None = None  # where the loop was left (engine/session/open_runs.py)
        self._sessions: SessionLog | None = None
        self._stop: StopFlag | None = None
        self._close_previous()  # the Run cell was run again while the old loop is open

    def _for_tool(self, hooks: ToolHooks) -> Run:
        """For tools built on the engine (``resumable-train``, chaos, tests), before the loop starts: ``computation``
        replaces what a checkpoint must match, ``settings`` what each manifest records as the run's options,
        ``prepared`` an already opened run dir and its choice of checkpoint, ``faults`` injects faults on purpose,
        and ``amp_switch`` (``{"from": "bf16", "to": "fp16", "why": ...}``) accepts that one change of the
        computation's ``amp`` from the checkpoint's, starts a GradScaler the checkpoint lacks fresh, and records the
        switch in ``sessions.jsonl`` (engine/state/hardware.py: ``--amp auto`` on a GPU without native bf16)."""
        if hooks.computation is not None:
            self.computation = json_value(dict(hooks.computation), "computation")
        if hooks.settings is not None:
            self.settings = json_value(dict(hooks.settings), "settings")
            self._api = False  # messages name the command line's options
        self._prepared = hooks.prepared
        if hooks.faults is not None:
            self.faults = hooks.faults
        self.amp_switch = dict(hooks.amp_switch) if hooks.amp_switch else None
        return self

    # -- results -----------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.outcome is not None and self.outcome.finished

    @property
    def exit_code(self) -> int:
        """0 when training is complete, 75 (EX_TEMPFAIL) when it stopped early with its state committed; 0 for a
        stop on purpose under torchrun, which must not restart the group (``resumable torchrun`` exits 75); 74
        (EX_IOERR) instead of 0 or 75 when a Drive run's newest committed checkpoint is not durable on Drive at
        exit (only in this VM's cache: run again here to upload it)."""
        if self._elastic_stop:
            return 0
        if self._not_durable:  # done or stopped, but the newest checkpoint is only in this VM's cache
            return EXIT_NOT_DURABLE
        return 0 if self.finished else EXIT_RESUME

    @property
    def stats(self) -> SaveStats | None:
        """Checkpoint figures of this session (None before training started)."""
        return self._keeper.writer.stats if self._keeper is not None else None

    def log(self, loss: torch.Tensor) -> None:
        """Report the loss of the batch just trained (not synced): train loss per epoch and log records."""
        if self._loop is not None:
            self._loop.report_loss(loss)

    # -- the loop ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        if self._iterated:
            ended = self.outcome.reason if self.outcome is not None else "left"
            raise RuntimeError(f"this Run has already trained a session (it ended: {ended}, at step "
                               f"{self.state.step}); to continue, run the cell (or code) that builds the Run again, "
                               f"then iterate the new Run: it resumes from the newest committed checkpoint")
        self._iterated = True
        self._loop_file = identity.caller_file(sys._getframe(1))
        generator = self._iterate()
        # Only the loop holds the generator: a loop left by break or an exception drops it, and CPython finalises
        # it at once, which ends the session there (engine/session/open_runs.py), instead of leaving its watchdog armed.
        self._iterator = weakref.ref(generator)
        return generator

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        self.close(error)

    def close(self, error: BaseException | None = None, reason: str = "closed") -> None:
        """Stop iterating (no new checkpoint; the newest committed one stays) and release the run dir.

        ``error``: the exception that ended the loop, recorded as how the session ended (``with run:`` passes
        it; an exception that leaves a plain ``for`` loop is recorded through ``sys.excepthook`` in a script and
        IPython's ``post_run_cell`` in a notebook: engine/session/open_runs.py). ``reason``: recorded when there is no
        error."""
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
        """``error`` was reported after this Run's loop was left: when it is the exception that unwound past the
        loop, record it as how the session ended (instead of "break"). Returns whether it was."""
        left, self._left_at = self._left_at, None
        if left is None or self._sessions is None or not open_runs.unwound(error, left):
            self._left_at = left
            return False
        detail = None if isinstance(error, KeyboardInterrupt) else error_detail(error)
        return self._sessions.amend(self.state.step, "break", describe_error(error), detail)

    def cell_ended(self, error: BaseException | None) -> None:
        """A notebook cell ended while this Run's loop is open (an iterator kept in a variable): control is outside
        the loop, so its hang watchdog waits for the next step (engine/session/open_runs.py)."""
        if self._loop is not None and self._loop.watchdog is not None:
            self._loop.watchdog.idle()
        if self._stop is not None:
            self._stop.suspend()  # Ctrl-C in other cells is theirs again

    def _close_previous(self) -> None:
        """Close an earlier Run of this process on the same run dir whose loop is still open (a notebook cell run
        again): its lock, threads and workers are released before this one opens the run dir."""
        previous = open_runs.get(self.run_dir)
        if previous is not None and previous is not self:
            log.info(f"closing the previous Run on {self.run_dir} in this process (its cell was run again?)")
            previous.close(reason="closed: a new Run on its run dir")

    def _iterate(self) -> Iterator[tuple[int, int, Any]]:
        if self.faults.describe():  # never silent: they change what the run does
            log.warning(f"faults injected on purpose ({self.faults.describe()}): a chaos test, not a normal run")
        self._close_previous()  # before choosing: its last save may still commit
        open_runs.wait_for_stuck_save(self.run_dir)
        self._identity = (identity.code_digest([self._built_in, self._loop_file, identity.class_file(self.model)]),
                          identity.config_digest(self.settings))
        if self._prepared is not None:
            rundir, choice = self._prepared
            self._identity = rundir.identity or self._identity  # the one its crash-loop check used
        else:
            rundir, choice = RunDir.open(self.dist, self.run_dir, self.options.cache_dir,
                                         self.options.drive_credentials, self.mode, self.overwrite, self.resume_from,
                                         self.ignore_crash_loop or self.faults.ignore_crash_loop, self._identity)
        self._rundir = rundir
        open_runs.add(self.run_dir, self)
        try:
            with log.quiet(self.options.quiet):
                self._restore(rundir, choice)
                yield from self._train(rundir, choice)
        finally:
            open_runs.remove(self.run_dir, self)
            rundir.release()

    def _restore(self, rundir: RunDir, choice: Choice) -> None:
        """Build the keeper and load the chosen checkpoint on every rank (they fail together)."""
        main = self.dist.main
        if main:
            rundir.local.mkdir(parents=True, exist_ok=True)
        if main and rundir.remote is not None:
            # Once another machine took the lease over, its session owns the remote: this mirror stops at once.
            self._mirror = Mirror(rundir.manager, rundir.remote, rundir.local, log.info, run_id=choice.run_id,
                                  lost=lambda: rundir.lost, after_upload=self._after_upload)
        self._metrics = MetricsLog(rundir.local / METRICS if main else None)
        switch = self.amp_switch
        # where this session trains (engine/state/hardware.py): recorded in each manifest, compared at a resume
        where = {**hardware.describe(self.device), **({"amp_dtype": self.amp} if self.amp is not None else {})}
        self._keeper = StateKeeper(
            CheckpointManager(checkpoints_dir(rundir.local), ShardedFormat(
                self.options.shard_size_bytes, faults=self.faults,
                share_limit=self.options.keep - 1 if self.options.keep >= 2 else None), self.faults),
            self._objects, self.state,
            meta={"config": self.settings, "computation": self.computation, "device": str(self.device),
                  "world_size": self.dist.world_size, "run_id": choice.run_id, **self._tracking(choice), **where},
            keep=self.options.keep, keep_best=self.options.keep_best,
            writer=CheckpointWriter(asynchronous=not self.options.sync_checkpoints),
            before_commit=lambda: self._report.before_commit(),
            after_commit=self._after_commit, dist=self.dist,
            faults=self.faults, modules=self._objects["model"], store_frozen=self.options.store_frozen,
            staging_memory=self.options.staging_memory_bytes,
            protect=self._mirror.protected if self._mirror is not None else None,
            fresh=frozenset({"scaler"}) if switch else frozenset())  # a GradScaler the checkpoint lacks starts fresh
        for setting in determinism.set_cheap_defaults():  # before the checkpoint's settings are compared
            if self.device.type == "cuda":  # set on every device (it is recorded), said only where cuBLAS runs
                log.info(f"set {setting} for deterministic cuBLAS (see docs/resuming.md: bit-identical)")
        check_schedulers(self._objects, resuming=choice.latest is not None)  # the same on every rank
        error: Exception | None = None
        if choice.latest is not None:
            try:
                info = self._keeper.resume(
                    choice.latest, choice.skipped, self.computation, self.run_dir, self._api,
                    ignore=frozenset({"num_samples"}) if self.allow_data_change else frozenset(),
                    accept={"amp": (switch["from"], switch["to"])} if switch else None)
                if self.allow_data_change:
                    self.data_change = accept_data_change(info, self.computation.get("num_samples"), self.state)
                    if self.data_change:  # another order from here on, by request: not a resume that went wrong
                        self._keeper.data_next = None
            except Exception as e:  # noqa: BLE001 - any failure (an OSError too) must reach every rank
                error = e
            else:
                self.resumed_from = info.step
                if main:
                    try:
                        self._keeper.check_room()
                    except ResumableError as e:
                        error = e
                saved_world = info.manifest.get("world_size", 1)
                if saved_world != self.dist.world_size:
                    remap_position(self.state, self.sampler, saved_world, self.accumulate, self.dist.world_size)
                cost = self._keeper.restore_cost
                known = cost is not None and cost.added is not None
                memory = f", host memory peak +{cost.added / 1e6:.0f} MB" if known else ""
                log.info(f"resuming from step {info.step} (epoch {self.state.epoch}, batch "
                         f"{self.state.batch_in_epoch}), saved {describe_age(info.created)}; loaded in "
                         f"{cost.seconds if cost is not None else 0:.2f}s{memory}")
                ahead = self._keeper.data_next
                first = (f"; the first batch is compared with the checkpoint's record of its {ahead['of']}"
                         if ahead else "")
                log.info(f"resume verified {self._keeper.verified}{first}")
        failed = self.dist.all_errors(None if error is None else str(error) if isinstance(error, ResumableError)
                                      else f"{type(error).__name__}: {error}")
        if failed:
            if error is not None:
                raise error
            rank, message = failed[0]
            raise ResumableError(f"rank {rank} could not load the checkpoint: {message}")
        if choice.latest is None:  # the same fresh start every time in this process (engine/session/fresh_start.py)
            line = fresh_start.start_fresh(self.run_dir, {name: (self._given.get(name), obj) for name, obj
                                                         in self._objects.items() if name != "sampler"},
                                          self.model, keep_copy=notebook.interactive())
            if line is not None:
                log.info(line)
        else:
            fresh_start.forget(self.run_dir)
        if self.resumed_from is None and not self.model.training:
            log.info("the model was in eval mode; training it in train mode (model.train())")
            self.model.train()

    def _after_upload(self) -> None:
        """The Drive mirror finished an upload (on its thread): a step retention kept for it may go now."""
        if self._keeper is not None:
            self._keeper.prune()

    def _after_commit(self, step: int) -> None:
        """A checkpoint committed (on the writer's thread): this run's fresh start is on disk now, and Drive gets it."""
        fresh_start.forget(self.run_dir)
        if self._mirror is not None:
            self._mirror.submit(step)

    def _tracking(self, choice: Choice) -> dict[str, Any]:
        """The W&B run id for the manifests (reporting/wandb.py): kept out of ``computation``, so it never
        blocks a resume."""
        self._wandb_id = choose_id(choice.latest.manifest if choice.latest is not None else None, self._tracker)
        return {WANDB_ID: self._wandb_id} if self._wandb_id is not None else {}

    def _reporters(self, rundir: RunDir) -> Reporters:
        main = self.dist.main
        reporters: list[Reporter] = [MetricsReporter(self._metrics)]
        if self.options.tensorboard and main:
            reporters.append(TensorBoardReporter(TensorBoardLog(rundir.local)))
        if self._tracker is not None and main:
            reporters.append(WandbReporter(self._wandb_id, self.options.wandb, rundir.local, rundir.local / METRICS,
                                           self.settings, run=None if self._tracker == "wandb" else self._tracker))
        if self.options.progress and not self.options.quiet and main:
            reporters.append(ProgressReporter())
        reporters.append(ConsoleReporter())
        note = (f"dataset changed from {self.data_change[0]} to {self.data_change[1]} samples (allow_data_change)"
                if self.data_change else None)
        self._sessions = SessionLog(rundir.local if main else None)
        extra = {"device": hardware.label(self._keeper.meta),
                 **({"amp_switch": self.amp_switch} if self.amp_switch else {}),
                 "code": self._identity[0], "config": self._identity[1]}
        reporters.append(HistoryReporter(self._sessions, note, extra))
        return Reporters(reporters)

    def _train(self, rundir: RunDir, choice: Choice) -> Iterator[tuple[int, int, Any]]:
        """Everything that modifies the run dir (rank 0 holds its lock)."""
        keeper, state, main = self._keeper, self.state, self.dist.main
        manager = keeper.manager
        stopped = planned_stop_before_restart(self.dist, rundir.local)
        if stopped is not None:  # torchrun restarted the group after a crash, but this job had stopped on purpose
            log.info(f"this torchrun job stopped on purpose at step {stopped.step} ({stopped.reason}) before the "
                     f"group was restarted: not training again. Run the same command again to continue")
            self.outcome, self._elastic_stop = Outcome(False, stopped.reason), True
            return
        if self.mode == "fresh" and self.overwrite and main:
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
        plan = LoopPlan(epochs=self.options.epochs, max_steps=self.options.max_steps,
                        log_every=self.options.log_every, on_save_error=self.options.on_save_error,
                        accumulate=self.accumulate)
        ended, interrupted = "interrupted", False  # the loop was left by break, an exception or close()
        with StopFlag() as stop:
            self._stop = stop
            session_budget = budget(self.options)
            if self._mirror is not None:  # the final checkpoint must reach Drive before the limit, not only disk
                session_budget.durable_s = self._mirror.pace.durable_s
            loop = Loop(keeper, self.sampler, plan, report, self._end_epoch, self._current_lr, self.device,
                        triggers=triggers(self.options), stop=stop, budget=session_budget,
                        on_interval=self._announce_interval if self.options.checkpoint_every == "auto" else None,
                        dist=self.dist, lost=(lambda: rundir.lost) if main else None)
            self._loop = loop
            if loop.finished() and self.resumed_from is not None:
                log.summary(f"run in {self.run_dir} is already complete at step {state.step} (epoch {state.epoch}); "
                            f"raise epochs or max_steps to train further")
                self.outcome = Outcome(True, "finished")
                self._close_mirror(interrupted=False)
                return
            ranks = f" (rank {self.dist.rank} of {self.dist.world_size})" if self.dist.active else ""
            log.info(f"training on {self.device}{ranks} with {torch.get_num_threads()} CPU thread(s): step "
                     f"{state.step} → {loop.total_steps or 'the end of the data'}, checkpoints in {manager.root}",
                     all_ranks=True)
            report.session_start(state.step, loop.total_steps, self.resumed_from)
            loop.watchdog = self._watch(rundir, state.step)
            completed, hung = False, False
            try:
                yield from self._batches(loop)
                self.outcome = self._confirmed(loop.outcome, manager) if main else loop.outcome
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
                    open_runs.left(self)  # the exception, if one left it, is reported next (session/open_runs.py)
                else:  # closed: by close(), ``with run:``, or a new Run on this run dir
                    ended = self._ended_by
                if self._error:
                    self._sessions.note_error(self._error)
                raise
            except Exception as e:  # raised inside the engine (evaluate(), a fault): recorded for the crash-loop check
                ended = describe_error(e)
                self._sessions.note_error(error_detail(e))
                raise
            finally:
                stop.armed = False  # from here on nothing is raised in this thread on the watchdog's behalf
                saving_hung = loop.watchdog is not None and loop.watchdog.hung_on == "save"
                if loop.watchdog is not None:
                    loop.watchdog.stop()  # the final uploads are not watched
                if not completed:
                    self._wait_quietly(at_once=stop.forced or hung and saving_hung)
                report.session_end(state.step, ended)
                self._close_mirror(interrupted or stop.forced or hung)
        self._summarise()
        if not self.finished and record_planned_stop(self.dist, rundir.local, self.outcome.reason, state.step):
            # torchrun counts exit 75 as a failure and would restart the group (training on, past the stop, with
            # a fresh budget); exit 0 ends it, and `resumable torchrun` reads the marker and exits 75
            self._elastic_stop = True
            log.info(f"under torchrun this worker exits 0, so that the group is not restarted; `resumable torchrun` "
                     f"exits {EXIT_RESUME} for this stop (plain torchrun exits 0)")

    def _watch(self, rundir: RunDir, step: int) -> Watchdog | None:
        """Arm the step watchdog (engine/loop/watchdog.py); every rank runs its own and writes its own stack file."""
        if not self.options.watchdog_on:
            return None
        session = self.dist.broadcast(self._sessions.number)  # rank 0 numbers the sessions: one name on every rank
        stats = self._keeper.writer.stats
        # In a notebook the process is the user's kernel: a hang raises in the training thread instead of exiting.
        interrupt = self._stop.interrupt if notebook.interactive() and self._stop is not None else None
        return start_watchdog(self.options.hang_timeout, self.options.hang_timeout_s, rundir.local, self.dist.rank,
                              session, step, self._sessions.end if self.dist.main else None,
                              self._keeper.writer.wait_idle, slowest_save=lambda: stats.slowest_s,
                              interrupt=interrupt)

    def _confirmed(self, outcome: Outcome | None, manager: CheckpointManager) -> Outcome | None:
        return confirm_committed(outcome, manager, self.state.step)

    def _batches(self, loop: Loop) -> Iterator[tuple[int, int, Any]]:
        """The loop's positions turned into batches from the data source, one epoch iterator at a time."""
        fetch, fetch_epoch = None, None
        watch = TrainingWatch([o for o in self._objects.values() if hasattr(o, "param_groups")], self._objects["model"])
        try:
            for epoch, index, item, last in loop.run():
                if fetch_epoch != epoch:
                    fetch, fetch_epoch = self.source.epoch(self.sampler, epoch, index), epoch
                self.end_of_epoch = last
                self.sync_step = (index + 1) % self.accumulate == 0 or last
                batch = fetch(item)
                watch.begin()
                yield epoch, self.state.step, batch
                if loop.watchdog is not None:
                    loop.watchdog.wake()  # a notebook cell that left the loop suspended made it idle
                if self._stop is not None:
                    self._stop.resume()  # ... and gave the signals back
                if self.sync_step:  # an optimizer step is done: it stepped the Run's objects, or stop here
                    watch.check()
        finally:
            watch.close()
            self.source.close()

    def _wait_quietly(self, at_once: bool = False) -> None:
        """Let an in-flight save finish (it is consistent) without raising over another exception; give it up when
        it is stuck (ending.finish_save), at once after a second interrupt or when the watchdog found it hung."""
        writer = self._keeper.writer
        watchdog = self._loop.watchdog if self._loop is not None else None
        bound = 0.0 if at_once else watchdog.save_limit() if watchdog is not None else DURATION_MAX_S
        if finish_save(writer, bound, self._stop):
            open_runs.stuck(self.run_dir, writer)  # a new session on this run dir waits for it first

    def _close_mirror(self, interrupted: bool) -> None:
        if self._mirror is not None:
            stop = self._stop
            self._not_durable = close_mirror(self._mirror, self.options.drive_flush_timeout, interrupted,
                                             self._loop.budget if self._loop is not None else None,
                                             (lambda: stop.forced) if stop is not None else None)

    def _summarise(self) -> None:
        summarise(self._keeper, self.state, self.outcome, self._rundir.lost if self._rundir else None,
                  self.run_dir)

    def _end_epoch(self, epoch: int) -> dict[str, float]:
        """``evaluate()``, with every module's train/eval mode as it was before (an evaluate that leaves the
        model in eval mode would otherwise train the next epoch without dropout)."""
        if self.evaluate is None:
            return {}
        modes = [(m, m.training) for m in self.model.modules()]
        try:
            return {k: float(v) for k, v in dict(self.evaluate()).items()}
        finally:
            for module, training in modes:
                module.training = training

    def _current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _announce_interval(self, interval: float, cost: float) -> None:
        announced = getattr(self, "_announced", None)
        if announced is not None and abs(interval - announced) <= 0.1 * announced:
            return  # only when it changes noticeably
        self._announced = interval
        log.info(f"--checkpoint-every auto: a save blocks training {cost * 1000:.1f} ms, MTBF {self.options.mtbf} "
                 f"→ checkpoint every {format_duration(interval)}")


__all__ = ["IndexBatches", "Run"]
