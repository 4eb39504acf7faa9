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

A :class:`Run` is the same engine ``resumable-train`` uses. It holds what the user gave (turned into the engine's
parts: the data source and its order, the objects to checkpoint, the options) and the results; each ``for ... in
run`` is a session (engine/session/training_session.py) that opens the run dir (engine/rundir/: location, lock,
Drive restore, choice of checkpoint), loads it through the state keeper (engine/state/) and trains through the loop
(engine/loop/: steps, epochs, saves, stops), reporting to reporting/. After the loop, ``run.finished`` says whether
training is complete; otherwise it stopped early with its state committed, and running the same code again
continues.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .. import log
from ..checkpoint.retention import Best
from ..checkpoint.writer import SaveStats
from ..config import RunOptions
from ..distributed import Distributed
from ..errors import EXIT_NOT_DURABLE, EXIT_RESUME
from ..faults import Faults
from ..faults import installed as installed_faults
from ..policies import (
    Checkpointing,
    Evaluation,
    Loader,
    Location,
    Reporting,
    Session,
    evaluation_of,
    location_of,
    to_options,
)
from ..reporting.mlflow import require_mlflow
from ..reporting.trackio import require_trackio
from ..reporting.wandb import require_wandb
from .data.more_sources import PREFIX, MoreBatches
from .data.sources import IndexBatches
from .data.wrap import as_source
from .loop.plan import Outcome
from .rundir.run_dir import Choice, RunDir
from .session import identity, open_runs
from .session.training_session import TrainingSession
from .state import hardware
from .state.compatibility import json_value
from .state.train_state import Stateful, TrainState, as_stateful, plain_module

_BUILT_IN = ("model", "optimizer", "scheduler", "scaler", "sampler")


_REQUIRE = {"wandb": require_wandb, "mlflow": require_mlflow, "trackio": require_trackio}


def trackers_of(tracker: Any, options: RunOptions) -> dict[str, Any]:
    """The trackers on: ``tracker`` ("wandb", "mlflow", "trackio" or a W&B run object) and those the Reporting
    names (``wandb=``/``mlflow=``/``trackio=``), as {"wandb": "wandb" or the W&B run, "mlflow": ..., "trackio": ...};
    each one's package checked before anything starts (exit 2 with the pip command)."""
    on: dict[str, Any] = {name: name for name in _REQUIRE if getattr(options, name) is not None}
    if isinstance(tracker, str) and tracker in _REQUIRE:
        on[tracker] = tracker
    elif tracker is not None:
        if type(tracker).__module__.split(".")[0] in ("trackio", "mlflow"):
            raise ValueError(f"tracker={tracker!r}: a trackio or MLflow run object is not taken (resumable opens and "
                             f"resumes that run itself); pass tracker='trackio' or tracker='mlflow' instead")
        if not (callable(getattr(tracker, "log", None)) and hasattr(tracker, "id")):
            raise ValueError(f"tracker={tracker!r} must be 'wandb', 'mlflow', 'trackio' or a W&B run "
                             f"(wandb.init(...)); None for none")
        on["wandb"] = tracker
    for name, value in on.items():
        if value == name:
            _REQUIRE[name]()
    return on


@dataclass(frozen=True)
class ToolHooks:
    """What tools built on the engine change about a Run (see :meth:`Run._for_tool`); not for training scripts."""

    computation: Mapping[str, Any] | None = None
    settings: Mapping[str, Any] | None = None
    prepared: tuple[RunDir, Choice, Opening] | None = None
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
    (``test_acc`` picks the best checkpoint); ``evaluate=Evaluation(fn, every_steps=500, monitor="val_loss",
    mode="min")`` runs it every 500 steps too and keeps the lowest ``val_loss``. It never changes the training run:
    the model's train/eval modes and every RNG stream are restored after it. ``objects`` adds
    more ``Stateful`` things to checkpoint (an EMA, a custom sampler, a ``torch``/``numpy``/``random``
    generator...). ``accumulate=K`` makes a step K micro-batches: call ``optimizer.step()`` when ``run.sync_step``
    is true; checkpoints are only taken between steps. ``config`` (JSON-able) is recorded and must match on resume.
    ``amp`` (none, bf16, fp16) is the autocast dtype the loop uses, recorded in each manifest as ``amp_dtype``.
    ``tracker="wandb"`` (or ``Reporting(wandb="project")``) logs the records to one Weights & Biases run across
    sessions; a W&B run object is logged to as it is (reporting/wandb.py). ``tracker="mlflow"`` or ``"trackio"``
    (or ``Reporting(mlflow="experiment", trackio="project")``) do the same with MLflow and trackio, each step once
    (reporting/mlflow.py, reporting/trackio.py).

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
                 evaluate: Callable[[], Mapping[str, float]] | Evaluation | None = None, accumulate: int = 1,
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
        self._trackers = trackers_of(tracker, self.options)  # {"wandb": "wandb" or a W&B run, "mlflow", "trackio"}
        self.model = model
        self.optimizer = optimizer
        self.dist = Distributed.current()  # torchrun: the user (or resumable-train) initialised the group
        log.set_rank(self.dist.rank)
        self.allow_data_change = session.allow_data_change
        self.source, self.sampler, size = as_source(data, loader.loader_options(), batch_size, seed, loader.shuffle,
                                                    loader.drop_last, self.dist, self.allow_data_change,
                                                    loader.sampler, loader.batch_sampler)
        self.accumulate = accumulate
        self.evaluation = evaluation_of(evaluate)  # None, or when it runs and what "best" means
        self.best = Best(self.evaluation.monitor, self.evaluation.mode) if self.evaluation else Best()
        self.device = torch.device(device) if device is not None else hardware.device_of(model)
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
        self._prepared: tuple[RunDir, Choice] | None = None
        self.resume_from, self.ignore_crash_loop = session.resume_from, session.ignore_crash_loop
        self.amp, self.amp_switch = amp, None
        self._built_in = identity.caller_file(sys._getframe(1))  # the script or notebook cell that built it
        self._session: TrainingSession | None = None  # the session iterating this Run (engine/session/)
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
        if hooks.prepared is not None:
            rundir, choice, opening = hooks.prepared
            self._prepared = (rundir, choice)
            self.mode, self.overwrite = opening.mode, opening.overwrite
        if hooks.faults is not None:
            self.faults = hooks.faults
        if hooks.amp_switch:
            self.amp_switch = dict(hooks.amp_switch)
        return self

    # -- results -----------------------------------------------------------------------------------
    @property
    def outcome(self) -> Outcome | None:
        """How the session ended (None while it trains): finished, or why it stopped early."""
        return self._session.outcome if self._session is not None else None

    @property
    def finished(self) -> bool:
        return self._session is not None and self._session.finished

    @property
    def resumed_from(self) -> int | None:
        """The step of the checkpoint this session resumed from (None: a fresh start)."""
        return self._session.resumed_from if self._session is not None else None

    @property
    def data_change(self) -> tuple[int, int] | None:
        """(the checkpoint's, now): the dataset's sizes, when it changed (Session(allow_data_change=True))."""
        return self._session.data_change if self._session is not None else None

    @property
    def sync_step(self) -> bool:
        """This micro-batch completes an optimizer step (see ``accumulate``)."""
        return self._session is None or self._session.sync_step

    @property
    def end_of_epoch(self) -> bool:
        """This batch is the epoch's last (step a per-epoch scheduler here)."""
        return self._session is not None and self._session.end_of_epoch

    @property
    def exit_code(self) -> int:
        """0 when training is complete, 75 (EX_TEMPFAIL) when it stopped early with its state committed; 0 for a
        stop on purpose under torchrun, which must not restart the group (``resumable torchrun`` exits 75); 74
        (EX_IOERR) instead of 0 or 75 when a Drive run's newest committed checkpoint is not durable on Drive at
        exit (only in this VM's cache: run again here to upload it)."""
        session = self._session
        if session is not None and session.elastic_stop:
            return 0
        if session is not None and session.not_durable:  # the newest checkpoint is only in this VM's cache
            return EXIT_NOT_DURABLE
        return 0 if self.finished else EXIT_RESUME

    @property
    def stats(self) -> SaveStats | None:
        """Checkpoint figures of this session (None before training started)."""
        keeper = self._session.keeper if self._session is not None else None
        return keeper.writer.stats if keeper is not None else None

    def log(self, loss: torch.Tensor) -> None:
        """Report the loss of the batch just trained (not synced): train loss per epoch and log records."""
        if self._session is not None and self._session.loop is not None:
            self._session.loop.report_loss(loss)

    def loader(self, name: str, data: Any, batch_size: int, *, shuffle: bool = True, drop_last: bool = False,
               loader: Loader | None = None) -> MoreBatches:
        """Declare another source of batches (before the loop): ``next(it)`` inside the loop gives its next batch, in
        its own order, epoch after epoch. Its position is checkpointed with the run, so a resume continues it
        exactly (engine/data/more_sources.py). ``data``: a map-style Dataset (through a DataLoader as ``loader``
        says: workers, collate_fn...) or :class:`resumable.IndexBatches`."""
        if self._session is not None:
            raise RuntimeError(f"run.loader({name!r}, ...) must come before the loop (`for ... in run`): its position "
                               f"is part of every checkpoint from the first one")
        if not isinstance(name, str) or not name:
            raise ValueError(f"run.loader(name={name!r}): give each source a name, e.g. 'noise'")
        key = PREFIX + name
        if key in self._objects:
            raise ValueError(f"run.loader({name!r}, ...) was declared twice, or clashes with objects={{{key!r}: ...}}")
        options = loader or Loader()
        if options.sampler is not None or options.batch_sampler is not None:
            raise ValueError(f"run.loader({name!r}, ...): a source of its own is ordered by resumable (shuffle=, "
                             f"drop_last=); Loader(sampler=/batch_sampler=) is for the Run's data= only")
        source = MoreBatches(name, data, batch_size, int(self.computation["seed"]), shuffle, drop_last,
                             options.loader_options(), self.dist, self.device)
        self._objects[key] = source
        return source

    # -- the loop ----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        if self._session is not None:
            ended = self.outcome.reason if self.outcome is not None else "left"
            raise RuntimeError(f"this Run has already trained a session (it ended: {ended}, at step "
                               f"{self.state.step}); to continue, run the cell (or code) that builds the Run again, "
                               f"then iterate the new Run: it resumes from the newest committed checkpoint")
        self._session = TrainingSession(self, identity.caller_file(sys._getframe(1)))
        return self._session.batches()

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
        if self._session is not None:
            self._session.close(error, reason)

    def amend_end(self, error: BaseException) -> bool:
        """``error`` was reported after this Run's loop was left: when it is the exception that unwound past the
        loop, record it as how the session ended (instead of "break"). Returns whether it was."""
        return self._session is not None and self._session.amend_end(error)

    def cell_ended(self, error: BaseException | None) -> None:
        """A notebook cell ended while this Run's loop is open (an iterator kept in a variable): control is outside
        the loop, so its hang watchdog waits for the next step (engine/session/open_runs.py)."""
        if self._session is not None:
            self._session.cell_ended()

    def _close_previous(self) -> None:
        """Close an earlier Run of this process on the same run dir whose loop is still open (a notebook cell run
        again): its lock, threads and workers are released before this one opens the run dir."""
        previous = open_runs.get(self.run_dir)
        if previous is not None and previous is not self:
            log.info(f"closing the previous Run on {self.run_dir} in this process (its cell was run again?)")
            previous.close(reason="closed: a new Run on its run dir")


# -- the entry for tools built on the engine ------------------------------------------------------------------------
@dataclass(frozen=True)
class Opening:
    """How a tool's run dir is opened: ``mode`` (auto, resume, fresh), ``overwrite``, ``resume_from`` (rewind to
    that step: engine/rundir/rewind.py), ``ignore_crash_loop`` (engine/rundir/crash_loop.py)."""

    mode: str = "auto"
    overwrite: bool = False
    resume_from: int | None = None
    ignore_crash_loop: bool = False


__all__ = ["IndexBatches", "Run"]
