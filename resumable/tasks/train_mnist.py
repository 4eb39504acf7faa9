"""``resumable-train``: reconcile the command line with the checkpoint, build the MNIST task, and train it
through the same :class:`~resumable.engine.run.Run` engine users get for their own models. The engine's tool entry
(engine/tool_entry.py ``train_task``) opens the run dir, chooses the checkpoint and asks :class:`MnistTraining` to build
the Run for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import log, platforms
from ..config import COMPUTATION_FIELDS, SESSION_FIELDS, TrainConfig
from ..distributed import Distributed
from ..engine.data.sources import IndexBatches
from ..engine.run import Opening, Run, ToolHooks
from ..engine.rundir.run_dir import Choice
from ..engine.session import identity
from ..engine.state import hardware, preflight
from ..engine.state.host_memory import keep_freed_blocks
from ..engine.state.train_state import seed_everything
from ..engine.tool_entry import TaskResult, train_task
from ..errors import ConfigMismatch, ResumableError
from ..policies import Location, from_options
from . import mnist
from .mnist_task import MnistTask


def resolve_config(explicit: dict[str, Any], saved: dict[str, Any] | None) -> TrainConfig:
    """Options given on the command line win; the rest come from the checkpoint (when resuming) or the
    defaults. A computation field given explicitly must equal the checkpoint's."""
    if saved is None:
        return TrainConfig(**explicit)
    base = {k: v for k, v in TrainConfig.from_dict(saved).to_dict().items() if k not in SESSION_FIELDS}
    for name in COMPUTATION_FIELDS:
        if name == "amp" and "auto" in (explicit.get(name), base.get(name)):
            continue  # resolved against the checkpoint's AMP dtype (its computation) in _resolve_amp
        if name in explicit and explicit[name] != base.get(name):
            raise ConfigMismatch(name, base.get(name), explicit[name], explicit.get("run_dir", "?"))
    return TrainConfig(**{**base, **explicit})


def _device_type(name: str, cpu_fallback: bool = False) -> str:
    """"cuda" or "cpu" for ``--device name``: a GPU that is there must pass its preflight (engine/state/preflight.py),
    else exit 2 with the fix, or the CPU with ``--cpu-fallback``."""
    if name == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        if name == "cuda":
            raise ResumableError("--device cuda was given but CUDA is not available here; use --device cpu or auto")
        return "cpu"
    hint = "--cpu-fallback to fall back to it when this check fails, or --device cpu"
    return preflight.usable_device("cuda", allow_cpu=cpu_fallback, hint=hint).type


def _pick_device(kind: str, dist: Distributed) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(dist.local_rank)  # under torchrun: one GPU per process
        return torch.device("cuda", dist.local_rank)
    return torch.device("cpu")


def train(explicit: dict[str, Any], mode: str = "auto", overwrite: bool = False, resume_from: int | None = None,
          ignore_crash_loop: bool = False) -> TaskResult:
    """Run ``resumable-train`` with the options the user gave explicitly (``resume_from``, ``ignore_crash_loop``:
    see engine/rundir/rewind.py and engine/rundir/crash_loop.py)."""
    task = MnistTraining(explicit)
    return train_task(task, Opening(mode, overwrite, resume_from, ignore_crash_loop))


class MnistTraining:
    """``resumable-train``'s task for the engine (engine/run.py ``Task``): the options given on the command line,
    built into a Run once the checkpoint it resumes is known."""

    def __init__(self, explicit: dict[str, Any]) -> None:
        self.explicit = dict(explicit)
        self._device_type: str | None = None
        if "run_dir" not in explicit and platforms.outside_kaggle_working(TrainConfig.run_dir):
            # on Kaggle the default run dir goes where a saved version keeps it (a notebook's cwd is there already)
            self.explicit["run_dir"] = str(platforms.KAGGLE_WORKING / TrainConfig.run_dir)

    def device_type(self) -> str:
        """Decided once per session: the GPU's preflight runs before the process group and the checkpoint."""
        if self._device_type is None:
            self._device_type = _device_type(self.explicit.get("device", TrainConfig.device),
                                             bool(self.explicit.get("cpu_fallback", TrainConfig.cpu_fallback)))
        return self._device_type

    def location(self) -> Location:
        given = self.explicit
        return Location(given.get("run_dir", TrainConfig.run_dir), cache_dir=given.get("cache_dir"),
                        credentials=given.get("drive_credentials"))

    def identity(self) -> tuple[str, str]:
        """What this session runs, for the crash-loop check: this task's code and the options given."""
        return identity.code_digest([__file__, mnist.__file__]), identity.config_digest(self.explicit)

    def build(self, dist: Distributed, choice: Choice) -> tuple[Run, Callable[[Any], torch.Tensor]]:
        latest = choice.latest
        cfg = resolve_config(self.explicit, latest.manifest.get("config") if latest is not None else None)
        device = _pick_device("cpu" if cfg.device == "cpu" else self.device_type(), dist)
        if device.type == "cpu":  # the step's large buffers reused, not mapped and faulted in again each step
            keep_freed_blocks()
        # Deterministic cuDNN kernels cost little on this small CNN; resumes are bit-identical on GPU too.
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        saved_computation = latest.manifest.get("computation") if latest is not None else None
        amp, amp_switch = _resolve_amp(cfg.amp, device, saved_computation, latest.step if latest else 0)
        task = MnistTask(cfg, device, world_size=dist.world_size, amp=amp)
        if dist.active:
            # Same initial weights on every rank (seeded, and DDP broadcasts rank 0's); other dropout masks.
            task.model = DistributedDataParallel(task.model, device_ids=[device.index] if device.index is not None
                                                 else None)
            if dist.rank:
                seed_everything(cfg.seed + 1_000_003 * dist.rank)
        policies = from_options(cfg.run_options(), cfg.run_dir)
        run = Run(model=task.model, optimizer=task.optimizer, scheduler=task.scheduler, scaler=task.scaler,
                  data=IndexBatches(lambda indices: indices, len(task.data.train)), batch_size=cfg.batch_size,
                  seed=cfg.seed, evaluate=task.evaluate, device=device, amp=amp, **policies)
        # what a checkpoint must match (the options that change the numbers), and what the next start inherits for
        # options not given again
        run._for_tool(ToolHooks(computation=task.computation(), settings=cfg.to_dict(), amp_switch=amp_switch))
        return run, task.train_step


def _resolve_amp(requested: str, device: torch.device, saved: Any, step: int) -> tuple[str, dict[str, Any] | None]:
    """The AMP mode this session trains with, and the switch to record (None: the checkpoint's mode is kept).

    ``saved`` is the newest checkpoint's computation (None: a fresh run). ``--amp auto`` picks for a fresh run and
    keeps a checkpoint's mode unless it cannot run well here (engine/state/hardware.py). An explicit ``--amp bf16`` on a
    GPU without native bf16 is obeyed with a warning: it runs (emulated, slowly), needs no GradScaler, and the
    user asked for it; ``--amp auto`` is the way to switch."""
    capability, native = hardware.probe(device)
    here = hardware.label(hardware.describe(device))
    if requested != "auto":
        if requested == "bf16" and device.type == "cuda" and hardware.choose_amp("cuda", capability, native) != "bf16":
            log.warning(f"--amp bf16 on {here}, which has no native bf16 (compute capability 8.0 or later): bf16 runs "
                        f"emulated, several times slower. --amp auto trains with fp16 and a GradScaler instead (and "
                        f"switches a resumed bf16 run to it)")
        return requested, None
    old = saved.get("amp", "none") if isinstance(saved, dict) else None
    if old is None:
        amp = hardware.choose_amp(device.type, capability, native)
        log.info(f"--amp auto: {amp} on {here}" + (" (no autocast on the CPU: bf16 there is usually slower than "
                                                   "float32)" if device.type == "cpu" else ""))
        return amp, None
    amp, why = hardware.resume_amp(old, device.type, capability, native)
    if why is None:
        if amp != hardware.choose_amp(device.type, capability, native):
            log.info(f"--amp auto: keeping the checkpoint's {amp} on {here} (a run's precision changes only when its "
                     f"own cannot run well here)")
        return amp, None
    log.warning(f"--amp auto: this run trained with {old} up to step {step}, but {here} {why}. Switching to {amp} "
                f"with a fresh GradScaler from here on: the numerics change at this step (recorded in sessions.jsonl)")
    return amp, {"from": old, "to": amp, "why": f"{here} {why}", "step": step}
