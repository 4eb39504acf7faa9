"""Validated, frozen training configuration.

Every click option of ``resumable-train`` maps to one field here. ``None`` means "off".
Fields in :data:`COMPUTATION_FIELDS` change the numbers a run computes, so a resumed run must use
the checkpoint's values for them; the others (epochs, max_steps, paths, checkpoint policy) may change
between sessions.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEVICES = ("auto", "cpu", "cuda")
LR_SCHEDULES = ("none", "step", "onecycle")
# auto: bf16 where the GPU has it natively, fp16 + GradScaler on older GPUs, none on CPU (engine/state/hardware.py)
AMP_MODES = ("none", "bf16", "fp16", "auto")
# torch takes seeds up to 2**64 - 1; 2**63 - 1 leaves room for the offset each DDP rank adds to the seed.
SEED_MAX = 2**63 - 1
# The longest duration accepted: far beyond any session, and well inside what threading timeouts take
# (a longer wait raises OverflowError deep inside a join).
DURATION_MAX_S = 366 * 24 * 3600.0

# Fields whose change alters the computation; checked against the checkpoint on resume.
COMPUTATION_FIELDS = ("task", "batch_size", "seed", "lr", "lr_schedule", "amp")
# Fields that belong to one invocation and are never inherited from a checkpoint.
SESSION_FIELDS = ("run_dir", "cpu_fallback", "progress", "download", "time_limit", "cache_dir", "drive_credentials",
                  "tensorboard", "wandb", "mlflow", "trackio", "quiet")


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
    quiet: bool = False  # only warnings, errors and the final summary (no progress bars, no info lines)
    tensorboard: bool = False
    wandb: str | None = None  # a W&B project: log the records there, one W&B run across sessions
    mlflow: str | None = None  # an MLflow experiment: the same, one MLflow run across sessions
    trackio: str | None = None  # a trackio project: the same, one trackio run across sessions
    store_frozen: bool = False  # store frozen tensors too (default: recorded by fingerprint, not written)
    shard_size: str = "256MB"  # the most tensor bytes per safetensors file of a checkpoint
    staging_memory: str | None = None  # host memory for asynchronous saves; None: half of the free memory
    hang_timeout: str | None = "auto"  # a duration, "auto" (from the step times: engine/loop/watchdog.py) or None/"off"

    def __post_init__(self) -> None:
        for name in ("shard_size", "staging_memory"):
            value = getattr(self, name)
            if value is not None:
                try:
                    size = parse_size(value)
                except ValueError as e:
                    raise ValueError(f"{name}={value!r}: {e}") from None
                _require(size >= 1 or name == "staging_memory", name, value, "must be at least 1 byte")
        _require(self.epochs >= 1, "epochs", self.epochs, "must be at least 1")
        _require(self.max_steps is None or self.max_steps >= 0, "max_steps", self.max_steps,
                 "must be 0 or more")
        _require(self.on_save_error in ("warn", "stop"), "on_save_error", self.on_save_error,
                 "must be warn or stop")
        if self.cache_dir is not None:
            _require_path("cache_dir", self.cache_dir)
        for name in ("checkpoint_every", "mtbf", "time_limit", "drive_flush_timeout", "hang_timeout"):
            value = getattr(self, name)
            if value is not None and not (name in ("checkpoint_every", "hang_timeout") and value == "auto") and not (
                    name == "hang_timeout" and value == "off"):
                try:
                    parse_duration(value)
                except ValueError as e:
                    raise ValueError(f"{name}={value!r}: {e}") from None
        _require(self.checkpoint_steps is None or self.checkpoint_steps >= 1, "checkpoint_steps",
                 self.checkpoint_steps, "must be at least 1")
        _require(self.keep >= 1, "keep", self.keep, "must be at least 1 (the newest checkpoint is always kept)")
        _require(self.log_every >= 1, "log_every", self.log_every, "must be at least 1")
        for name, what in (("wandb", "a W&B project"), ("mlflow", "an MLflow experiment"),
                           ("trackio", "a trackio project")):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, str) and value.strip() != ""), name, value,
                     f"must be {what} name")

    @property
    def checkpoint_every_s(self) -> float | None:
        """Fixed wall-clock interval in seconds; None when off or auto."""
        if self.checkpoint_every in (None, "auto"):
            return None
        return parse_duration(self.checkpoint_every)

    @property
    def shard_size_bytes(self) -> int:
        return parse_size(self.shard_size)

    @property
    def staging_memory_bytes(self) -> int | None:
        return None if self.staging_memory is None else parse_size(self.staging_memory)

    @property
    def hang_timeout_s(self) -> float | None:
        """The fixed hang timeout in seconds; None when auto or off (see :attr:`watchdog_on`)."""
        return None if self.hang_timeout in (None, "auto", "off") else parse_duration(self.hang_timeout)

    @property
    def watchdog_on(self) -> bool:
        return self.hang_timeout not in (None, "off")

    @property
    def time_limit_s(self) -> float | None:
        return None if self.time_limit is None else parse_duration(self.time_limit)


def option_type_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be the option ``name`` of :class:`TrainConfig` (None: it can, or ``name`` is not one):
    checked where a manifest's recorded options are read, before a later start inherits them."""
    field = _OPTION_FIELDS.get(name)
    if field is None:
        return None
    kinds = [kind.strip() for kind in str(field.type).split("|")]
    for kind in kinds:
        if kind == "None" and value is None:
            return None
        if kind == "bool" and isinstance(value, bool):
            return None
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return None
        if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if kind == "str" and isinstance(value, str):
            return None
    return f"must be {' or '.join(kinds)}"


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
    cpu_fallback: bool = False  # a GPU that fails its preflight (engine/state/preflight.py): the CPU instead of exit 2
    lr_schedule: str = "none"
    amp: str = "none"
    download: bool = True
    # epochs, max_steps and the checkpoint, storage and logging options are inherited from RunOptions.

    def __post_init__(self) -> None:
        super().__post_init__()  # the engine's fields
        _require(self.batch_size >= 1, "batch_size", self.batch_size, "must be at least 1")
        _require(_real(self.lr) and math.isfinite(self.lr) and self.lr > 0, "lr", self.lr,
                 "must be a finite positive number")
        _require(type(self.seed) is int and 0 <= self.seed <= SEED_MAX, "seed", self.seed,
                 f"must be a whole number from 0 to {SEED_MAX} (2**63 - 1)")
        if not self.run_dir.startswith("gdrive://"):  # a Drive URL is checked where it is parsed
            _require_path("run_dir", self.run_dir)
        _require_path("data_dir", self.data_dir)
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


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_path(field: str, value: Any) -> None:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    problem = path_problem(value) if isinstance(value, str) else "is not a path (a string)"
    if problem:
        raise ValueError(f"{field}={value!r} {problem}")


def _pathconf(folder: Path, name: str, default: int) -> int:
    try:
        value = os.pathconf(folder, name)
    except (OSError, ValueError):  # not known here (or not a folder): the usual Linux limits
        return default
    return value if value > 0 else default


def path_problem(path: str) -> str | None:
    """Why the folder ``path`` can never be created or used here, or None.

    Checked before anything is created: an empty path would train into (or download MNIST into) the current
    folder, and a name longer than the file system allows fails only later, half-way through a start. Each
    new component is measured against ``NAME_MAX`` of the folder it would be created in, and the whole
    against ``PATH_MAX``.
    """
    if not path.strip():
        return "is empty; give a folder name such as runs/mnist (an empty path would mean the current folder)"
    if "\0" in path:
        return "contains a NUL byte, which no file name can hold"
    target = Path(os.path.abspath(path))
    try:
        length = len(os.fsencode(str(target)))
    except UnicodeEncodeError:
        return "is not a valid file name on this system (it cannot be encoded)"
    existing = target
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    path_max = _pathconf(existing, "PC_PATH_MAX", 4096)
    if length >= path_max:  # PATH_MAX counts the terminating NUL
        return (f"is {length} bytes long as an absolute path; this file system allows at most {path_max - 1}. "
                f"Use a shorter path")
    name_max = _pathconf(existing, "PC_NAME_MAX", 255)
    for part in target.relative_to(existing).parts:
        size = len(os.fsencode(part))
        if size > name_max:
            return (f"has a folder name of {size} bytes ({part[:24]}...); this file system allows at most "
                    f"{name_max} bytes per name. Use a shorter name")
    return None


_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE_MAX = 2**60


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``"256MB"``, ``"2GiB"``, ``"1.5GB"`` or a bare number of bytes.

    >>> parse_size("256MB")
    256000000
    """
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    if not isinstance(text, str):
        raise ValueError(f"size {text!r} is not a text; write it like 256MB, 2GiB or 0")
    source = text.strip().lower().replace(" ", "")
    digits = source.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = source[len(digits):]
    if unit not in _SIZE_UNITS or not digits or not all(c.isascii() and (c.isdigit() or c == ".") for c in digits) \
            or digits.count(".") > 1 or digits == ".":
        raise ValueError(f"size {text!r} is not like 256MB, 2GiB or a number of bytes")
    value = float(digits) * _SIZE_UNITS[unit]
    if not math.isfinite(value) or value > SIZE_MAX:
        raise ValueError(f"size {text!r} is larger than any memory or disk")
    return int(value)


def seconds_of(value: str | float | None, name: str) -> float | None:
    """An integration's ``name`` argument in seconds: a number or a duration text ("90s", "5m", "1h30m"); None stays
    None. ValueError naming ``name`` for anything not positive."""
    if value is None:
        return None
    seconds = parse_duration(value) if isinstance(value, str) else float(value)
    if not seconds > 0:
        raise ValueError(f"{name}={value!r} must be a positive number of seconds or a duration like '2h'")
    return seconds


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``"90s"``, ``"5m"``, ``"1h30m"``, ``"2h"`` or a bare number of seconds.

    >>> parse_duration("1h30m")
    5400.0
    """
    if not isinstance(text, str):
        raise ValueError(f"duration {text!r} is not a text; write it like '90s', '5m' or '1h30m'")
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
            if char.isascii() and (char.isdigit() or char == "."):  # isdigit alone takes '²' and '٣'
                number += char
            elif char in _UNITS and number and char not in seen and number.count(".") <= 1 and number != ".":
                seconds += float(number) * _UNITS[char]
                number, seen = "", seen + char
            else:
                raise ValueError(f"duration {text!r} is not like 90s, 5m or 1h30m")
        if number:
            raise ValueError(f"duration {text!r} has a number without a unit (s, m or h) at the end")
    # float() reads 'nan', 'inf' and overflows to inf: none of them is a duration (a NaN compares False with
    # every deadline, so a nan interval would never fire and a nan time limit would never stop).
    if not math.isfinite(seconds):
        raise ValueError(f"duration {text!r} is not a finite number of seconds; use e.g. 90s, 5m or 1h30m")
    if seconds <= 0:
        raise ValueError(f"duration {text!r} must be positive")
    if seconds > DURATION_MAX_S:
        raise ValueError(f"duration {text!r} is longer than the longest accepted, 366 days (8784h)")
    return seconds


def format_duration(seconds: float) -> str:
    """Inverse of :func:`parse_duration` for display: ``5400`` → ``"1h30m"``."""
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{v}{u}" for v, u in ((hours, "h"), (minutes, "m"), (secs, "s")) if v]
    return "".join(parts) or "0s"


_OPTION_FIELDS = {field.name: field for field in dataclasses.fields(TrainConfig)}
