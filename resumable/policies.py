"""The policies a :class:`resumable.Run` takes besides the things a training loop has: small frozen records, each
validated when it is built, each with defaults, so the common call stays one line::

    run = resumable.Run("runs/mine", model=model, optimizer=optimizer, data=train_set, batch_size=64, epochs=10,
                        checkpointing=resumable.Checkpointing(every="10m", keep=2),
                        session=resumable.Session(time_limit="11h"))

- :class:`Location`: where the run lives (a folder, a mounted Drive folder, or ``gdrive://``) with its Drive options;
  ``run_dir`` takes a plain path or one of these.
- :class:`Loader`: how a map-style dataset is loaded (shuffle, workers, collate...).
- :class:`Checkpointing`: when to save, what to keep, how saves are written.
- :class:`Session`: how this session starts (resume or not, from where) and when it stops (steps, time, hangs).
- :class:`Reporting`: what is printed and logged.
- :class:`Evaluation`: when ``evaluate`` runs and which metric picks the best checkpoint; ``evaluate`` takes a plain
  function (at each epoch's end, best by ``test_acc``) or one of these.

Nothing here imports torch. Each record checks its values when built (a ValueError names the field and the fix), and
:func:`to_options` gives the engine's one merged :class:`~resumable.config.RunOptions`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import RunOptions

_ENGINE_NAMES: dict[str, str] = {  # a policy's field -> the engine's option, where the names differ
    "credentials": "drive_credentials", "flush_timeout": "drive_flush_timeout", "every": "checkpoint_every",
    "steps": "checkpoint_steps", "synchronous": "sync_checkpoints", "on_error": "on_save_error",
}


class _Policy:
    """A policy's fields that are engine options (:data:`_OPTIONS`), checked when it is built."""

    _OPTIONS: tuple[str, ...] = ()

    def options(self) -> dict[str, Any]:
        """These fields under the engine's option names (:class:`~resumable.config.RunOptions`)."""
        return {_ENGINE_NAMES.get(name, name): getattr(self, name) for name in self._OPTIONS}

    def __post_init__(self) -> None:
        try:
            RunOptions(**self.options())
        except ValueError as e:  # "checkpoint_every='x': ..." -> "Checkpointing(every='x'): ..."
            message = str(e)
            for name in self._OPTIONS:
                engine = _ENGINE_NAMES.get(name, name)
                if message.startswith(f"{engine}="):
                    value = repr(getattr(self, name))
                    rest = message[len(engine) + 1 + len(value):].lstrip(":").strip()
                    message = f"{type(self).__name__}({name}={value}): {rest}"
                    break
            raise ValueError(message) from None


@dataclass(frozen=True)
class Location(_Policy):
    """Where a run lives: ``path`` (a local folder, a folder of a mounted Drive, or ``gdrive://root/<path>``) and,
    for ``gdrive://``, the VM's cache folder (``cache_dir``, default ``~/.cache/resumable``), the OAuth client
    secrets for a shell (``credentials``) and how long the end of a session waits for uploads (``flush_timeout``)."""

    path: str | os.PathLike[str]
    cache_dir: str | None = None
    credentials: str | None = None
    flush_timeout: str = "2m"
    _OPTIONS = ("cache_dir", "credentials", "flush_timeout")

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", os.fspath(self.path))
        super().__post_init__()


@dataclass(frozen=True)
class Loader:
    """How a map-style dataset becomes batches (a ``DataLoader`` per epoch over the Run's resumable sampler):
    ``shuffle``, ``drop_last``, ``num_workers``, ``collate_fn``, ``pin_memory`` and any other DataLoader
    ``options`` (``persistent_workers``, ``prefetch_factor``...; ``generator`` belongs to the Run).

    ``sampler``: your own index sampler instead of the Run's (batched by the Run's ``batch_size`` and ``drop_last``;
    ``shuffle`` no longer applies), e.g. ``WeightedRandomSampler(w, n, generator=torch.Generator())``;
    ``batch_sampler``: your own batches of indices, used as they are (any sizes, e.g. grouped by length). One of the
    two, with a ``__len__``, and one process only. A resume regenerates the epoch's indices and starts at the saved
    batch: O(1) when it has ``state_dict``/``load_state_dict``, ``set_epoch`` or a ``torch.Generator`` in
    ``.generator`` (seeded from (seed, epoch) by the Run), else by replaying its earlier epochs (docs/own-model.md)::

        Loader(batch_sampler=BucketBatchSampler(lengths, tokens=4096, generator=torch.Generator()))
    """

    shuffle: bool = True
    drop_last: bool = False
    num_workers: int = 0
    collate_fn: Callable | None = None
    pin_memory: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    sampler: Any = None
    batch_sampler: Any = None

    def __post_init__(self) -> None:
        if self.sampler is not None and self.batch_sampler is not None:
            raise ValueError("Loader(sampler=..., batch_sampler=...): give one of them: a sampler's indices are "
                             "batched by the Run's batch_size, a batch_sampler's batches are used as they are")
        if not (isinstance(self.num_workers, int) and not isinstance(self.num_workers, bool) and self.num_workers >= 0):
            raise ValueError(f"Loader(num_workers={self.num_workers!r}) must be 0 or more")

    def loader_options(self) -> dict[str, Any]:
        """The DataLoader keyword arguments (None ones left out)."""
        given = {"num_workers": self.num_workers, "collate_fn": self.collate_fn, "pin_memory": self.pin_memory,
                 **dict(self.options)}
        return {k: v for k, v in given.items() if v is not None}


@dataclass(frozen=True)
class Checkpointing(_Policy):
    """When to save and what to keep. ``every``: a wall-clock interval (``"5m"``), ``"auto"`` (from the measured
    save cost and ``mtbf``, Young's formula) or None; ``steps``: every N optimizer steps as well. ``keep``: the
    newest N committed checkpoints (``keep_best`` also keeps the best one: by ``test_acc``, or as
    :class:`Evaluation` says). ``synchronous``: write in the training thread (default: a background writer).
    ``on_error``: ``"warn"`` (train on) or ``"stop"`` when a save fails. ``store_frozen``: write frozen tensors too
    (default: recorded by fingerprint). ``shard_size``: the most tensor bytes per file; ``staging_memory``: host
    memory for background saves (default: half the free)."""

    every: str | None = "5m"
    steps: int | None = None
    keep: int = 3
    keep_best: bool = True
    mtbf: str = "1h"
    synchronous: bool = False
    on_error: str = "warn"
    store_frozen: bool = False
    shard_size: str = "256MB"
    staging_memory: str | None = None
    _OPTIONS = ("every", "steps", "keep", "keep_best", "mtbf", "synchronous", "on_error", "store_frozen",
                "shard_size", "staging_memory")


@dataclass(frozen=True)
class Session(_Policy):
    """How this session starts and when it stops. ``resume``: ``"auto"`` (the newest valid checkpoint, if any),
    ``"must"`` (one is required) or ``"never"`` (``overwrite=True`` discards existing checkpoints); ``resume_from``:
    continue from that step's checkpoint instead of the newest. ``allow_data_change``: continue a run whose dataset
    changed length, at an epoch boundary. ``ignore_crash_loop``: start even when the last sessions all failed at the
    same step. ``max_steps``: stop after that many optimizer steps in all; ``time_limit``: this session's budget
    (``"11h30m"``; in Colab the VM's lifetime less 20 minutes by default); ``hang_timeout``: ``"auto"``, a duration
    or ``"off"`` (the step watchdog)."""

    resume: str = "auto"
    overwrite: bool = False
    resume_from: int | None = None
    allow_data_change: bool = False
    ignore_crash_loop: bool = False
    max_steps: int | None = None
    time_limit: str | None = None
    hang_timeout: str | None = "auto"
    _OPTIONS = ("max_steps", "time_limit", "hang_timeout")

    def __post_init__(self) -> None:
        if self.resume not in ("auto", "must", "never"):
            raise ValueError(f"Session(resume={self.resume!r}) must be auto, must or never")
        super().__post_init__()


@dataclass(frozen=True)
class Reporting(_Policy):
    """What a session prints and logs: a ``progress`` bar, ``quiet`` (warnings, errors and the summary only), a log
    record every ``log_every`` steps, ``tensorboard`` event files, and the trackers, each ONE tracker run across
    sessions: ``wandb``: a W&B project (the Run's ``tracker`` takes a W&B run object instead), ``mlflow``: an MLflow
    experiment (store: ``MLFLOW_TRACKING_URI``, else ``RUN_DIR/mlruns``), ``trackio``: a trackio project (store:
    ``TRACKIO_DIR``, else ``RUN_DIR/trackio``)."""

    progress: bool = True
    quiet: bool = False
    log_every: int = 10
    tensorboard: bool = False
    wandb: str | None = None
    mlflow: str | None = None
    trackio: str | None = None
    _OPTIONS = ("progress", "quiet", "log_every", "tensorboard", "wandb", "mlflow", "trackio")


@dataclass(frozen=True)
class Evaluation:
    """When the user's evaluation runs and what "best" means. ``fn()`` returns metrics (a mapping of floats); it runs
    every ``every_steps`` optimizer steps (None: not within an epoch) and, with ``at_epoch_end``, after each epoch's
    last step. It never changes the training run: the RNG streams and every module's train/eval mode are as if it had
    not run. Each evaluation is followed by a checkpoint that records its metrics. ``monitor`` names the metric that
    picks the best checkpoint, ``mode`` whether higher (``"max"``) or lower (``"min"``) is better;
    ``Checkpointing(keep_best=True)`` keeps that checkpoint through retention and on Drive."""

    fn: Callable[[], Mapping[str, float]]
    every_steps: int | None = None
    at_epoch_end: bool = True
    monitor: str = "test_acc"
    mode: str = "max"

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(f"Evaluation(fn={self.fn!r}) must be a function that returns metrics, e.g. "
                             f"{{'val_loss': 0.31}}")
        steps = self.every_steps
        if steps is not None and not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
            raise ValueError(f"Evaluation(every_steps={steps!r}) must be a number of optimizer steps >= 1, or None")
        if steps is None and not self.at_epoch_end:
            raise ValueError("Evaluation(every_steps=None, at_epoch_end=False) would never evaluate: give every_steps "
                             "or leave at_epoch_end=True")
        if not isinstance(self.monitor, str) or not self.monitor:
            raise ValueError(f"Evaluation(monitor={self.monitor!r}) must name a metric fn() returns, e.g. 'val_loss'")
        if self.mode not in ("max", "min"):
            raise ValueError(f"Evaluation(mode={self.mode!r}) must be 'max' (higher is better, e.g. accuracy) or "
                             f"'min' (lower is better, e.g. a loss)")


def evaluation_of(evaluate: Callable[[], Mapping[str, float]] | Evaluation | None) -> Evaluation | None:
    """``Run(evaluate=...)`` as an :class:`Evaluation`: a plain function runs at each epoch's end, best by test_acc."""
    if evaluate is None or isinstance(evaluate, Evaluation):
        return evaluate
    return Evaluation(evaluate)


def to_options(epochs: int, location: Location, checkpointing: Checkpointing, session: Session,
               reporting: Reporting) -> RunOptions:
    """The engine's one merged, validated record of the policies."""
    return RunOptions(epochs=epochs, **location.options(), **checkpointing.options(), **session.options(),
                      **reporting.options())


def location_of(run_dir: str | os.PathLike[str] | Location) -> Location:
    """``run_dir`` as a :class:`Location` (a plain path gets the default Drive options)."""
    return run_dir if isinstance(run_dir, Location) else Location(run_dir)


def from_options(options: RunOptions, path: str, **session: Any) -> dict[str, Any]:
    """The Run keyword arguments for ``options`` (``resumable-train``'s merged options; :func:`to_options` the
    other way): ``run_dir`` as a Location, ``epochs`` and the policies; ``session`` adds fields such as ``resume``."""
    def record(kind: type[_Policy], **extra: Any) -> Any:
        values = {name: getattr(options, _ENGINE_NAMES.get(name, name)) for name in kind._OPTIONS}
        return kind(**values, **extra)

    return {"run_dir": record(Location, path=path), "epochs": options.epochs, "checkpointing": record(Checkpointing),
            "session": record(Session, **session), "reporting": record(Reporting)}
