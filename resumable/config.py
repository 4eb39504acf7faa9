"""Validated, frozen training configuration.

Every click option of ``resumable-train`` maps to one field here. ``None`` means "off".
Fields in :data:`COMPUTATION_FIELDS` change the numbers a run computes, so a resumed run must use
the checkpoint's values for them; the others (epochs, max_steps, paths, checkpoint policy) may change
between sessions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("none", "step", "onecycle")
AMP_MODES = ("none", "bf16", "fp16")

# Fields whose change alters the computation; checked against the checkpoint on resume.
COMPUTATION_FIELDS = ("task", "batch_size", "seed", "lr", "lr_schedule", "amp")
# Fields that belong to one invocation and are never inherited from a checkpoint.
SESSION_FIELDS = ("run_dir", "progress", "download", "time_limit", "cache_dir", "drive_credentials", "tensorboard")


@dataclass(frozen=True)
class RunOptions:
    """How the engine runs and checkpoints any model: the options shared by ``resumable-train`` and
    :class:`resumable.Run`. None means "off"."""

    epochs: int = 10
    max_steps: int | None = None
    checkpoint_steps: int | None = None
    checkpoint_every: str | None = "5m"  # a duration, or "auto" (Young's formula with mtbf)
    mtbf: str = "1h"
    time_limit: str | None = None
    sync_checkpoints: bool = False
    on_save_error: str = "warn"
    cache_dir: str | None = None
    drive_credentials: str | None = None
    drive_flush_timeout: str = "2m"
    keep: int = 3
    keep_best: bool = True
    log_every: int = 10
    progress: bool = True
    tensorboard: bool = False

    def __post_init__(self) -> None:
        _require(self.epochs >= 1, "epochs", self.epochs, "must be at least 1")
        _require(self.max_steps is None or self.max_steps >= 0, "max_steps", self.max_steps,
                 "must be 0 or more")
        _require(self.on_save_error in ("warn", "stop"), "on_save_error", self.on_save_error,
                 "must be warn or stop")
        for name in ("checkpoint_every", "mtbf", "time_limit", "drive_flush_timeout"):
            value = getattr(self, name)
            if value is not None and not (name == "checkpoint_every" and value == "auto"):
                try:
                    parse_duration(value)
                except ValueError as e:
                    raise ValueError(f"{name}={value!r}: {e}") from None
        _require(self.checkpoint_steps is None or self.checkpoint_steps >= 1, "checkpoint_steps",
                 self.checkpoint_steps, "must be at least 1")
        _require(self.keep >= 1, "keep", self.keep, "must be at least 1 (the newest checkpoint is always kept)")
        _require(self.log_every >= 1, "log_every", self.log_every, "must be at least 1")

    @property
    def checkpoint_every_s(self) -> float | None:
        """Fixed wall-clock interval in seconds; None when off or auto."""
        if self.checkpoint_every in (None, "auto"):
            return None
        return parse_duration(self.checkpoint_every)

    @property
    def time_limit_s(self) -> float | None:
        return None if self.time_limit is None else parse_duration(self.time_limit)


@dataclass(frozen=True)
class TrainConfig(RunOptions):
    """Everything one ``resumable-train`` invocation needs.

    >>> TrainConfig(epochs=1, run_dir="runs/demo").epochs
    1
    """

    run_dir: str = "runs/mnist"
    data_dir: str = "data"
    task: str = "mnist"
    batch_size: int = 128
    lr: float = 1e-3
    seed: int = 1
    device: str = "auto"
    lr_schedule: str = "none"
    amp: str = "none"
    download: bool = True
    # epochs, max_steps and the checkpoint, storage and logging options are inherited from RunOptions.

    def __post_init__(self) -> None:
        super().__post_init__()  # the engine's fields
        _require(self.batch_size >= 1, "batch_size", self.batch_size, "must be at least 1")
        _require(self.lr > 0, "lr", self.lr, "must be positive")
        _require(self.seed >= 0, "seed", self.seed, "must be 0 or more")
        _require(self.device in DEVICES, "device", self.device, f"must be one of {', '.join(DEVICES)}")
        _require(self.lr_schedule in LR_SCHEDULES, "lr_schedule", self.lr_schedule,
                 f"must be one of {', '.join(LR_SCHEDULES)}")
        _require(self.amp in AMP_MODES, "amp", self.amp, f"must be one of {', '.join(AMP_MODES)}")
        _require(self.task == "mnist", "task", self.task, "only 'mnist' is built in")

    def run_options(self) -> RunOptions:
        return RunOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RunOptions)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def computation(self) -> dict[str, Any]:
        """The fields that must match a checkpoint to resume it exactly."""
        return {name: getattr(self, name) for name in COMPUTATION_FIELDS}

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a (possibly older) saved dict, ignoring fields this version does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _require(ok: bool, field: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"{field}={value!r} {why}")


_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``"90s"``, ``"5m"``, ``"1h30m"``, ``"2h"`` or a bare number of seconds.

    >>> parse_duration("1h30m")
    5400.0
    """
    source = text.strip().lower()
    if not source:
        raise ValueError("empty duration; use e.g. 90s, 5m or 1h30m")
    try:
        seconds = float(source)
    except ValueError:
        seconds = None
    if seconds is None:
        seconds, number, seen = 0.0, "", ""
        for char in source:
            if char.isdigit() or char == ".":
                number += char
            elif char in _UNITS and number and char not in seen:
                seconds += float(number) * _UNITS[char]
                number, seen = "", seen + char
            else:
                raise ValueError(f"duration {text!r} is not like 90s, 5m or 1h30m")
        if number:
            raise ValueError(f"duration {text!r} has a number without a unit (s, m or h) at the end")
    if seconds <= 0:
        raise ValueError(f"duration {text!r} must be positive")
    return seconds


def format_duration(seconds: float) -> str:
    """Inverse of :func:`parse_duration` for display: ``5400`` → ``"1h30m"``."""
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{v}{u}" for v, u in ((hours, "h"), (minutes, "m"), (secs, "s")) if v]
    return "".join(parts) or "0s"
