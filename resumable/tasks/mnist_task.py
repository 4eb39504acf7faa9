"""The training wiring of the seed task: model, Adam, optional LR schedule and AMP, one train step."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from ..config import TrainConfig
from ..engine.data.sampler import ResumableSampler
from ..engine.state.train_state import seed_everything
from . import mnist

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class MnistTask:
    """Everything ``resumable-train`` trains, built deterministically from ``cfg`` (seeded first)."""

    def __init__(self, cfg: TrainConfig, device: torch.device, world_size: int = 1, amp: str | None = None) -> None:
        """``amp``: the AMP mode actually used (``--amp auto`` resolved, engine/state/hardware.py); default
        ``cfg.amp``."""
        self.cfg = cfg
        self.amp = amp if amp is not None else cfg.amp
        if self.amp not in _AMP_DTYPES and self.amp != "none":
            raise ValueError(f"amp={self.amp!r} must be none, bf16 or fp16 once --amp auto is resolved")
        self.device = device
        self.data = mnist.load_mnist(cfg.data_dir, device, download=cfg.download)
        seed_everything(cfg.seed)
        self.model = mnist.build_model(device)
        self.optimizer = mnist.make_optimizer(self.model, cfg.lr, device)
        # Under torchrun each step covers world_size batches: the one-cycle schedule is as long as the real run.
        self.sampler = ResumableSampler(len(self.data.train), cfg.batch_size, cfg.seed, world_size=world_size)
        self.scheduler = self._scheduler()
        self.amp_dtype = _AMP_DTYPES.get(self.amp)
        # A GradScaler is needed for fp16 only: bf16 has float32's exponent range.
        self.scaler = torch.amp.GradScaler(device.type) if self.amp == "fp16" else None

    def _scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        if self.cfg.lr_schedule == "step":
            return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.7)
        if self.cfg.lr_schedule == "onecycle":
            return torch.optim.lr_scheduler.OneCycleLR(
                self.optimizer, max_lr=self.cfg.lr, total_steps=self.cfg.epochs * self.sampler.batches_per_epoch)
        return None

    def computation(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed exactly."""
        comp = {**self.cfg.computation(), "amp": self.amp, "dataset": self.data.identity}
        if self.cfg.lr_schedule == "onecycle":
            comp["epochs"] = self.cfg.epochs  # the one-cycle schedule length depends on it
        return comp

    def train_step(self, indices: torch.Tensor) -> torch.Tensor:
        images, labels = self.data.train.images[indices], self.data.train.labels[indices]
        self.optimizer.zero_grad(set_to_none=True)
        autocast = (torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype is not None
                    else nullcontext())
        with autocast:
            loss = mnist.loss_fn(self.model(images), labels)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        if self.cfg.lr_schedule == "onecycle" and self.scheduler.last_epoch + 1 < self.scheduler.total_steps:
            # OneCycleLR gives optimizer step k (0-based) the lr at position k of total_steps (this run's steps on
            # each rank), so the last step trains at the schedule's end. One step() more goes past the end, where
            # the curve rises again: the lr logged and checkpointed after the last step was 4.9e-6 instead of 4e-9
            # (2 ranks, mini-MNIST). So the schedule stays at its end.
            self.scheduler.step()
        return loss

    def evaluate(self) -> dict[str, float]:
        """End of an epoch: test loss and accuracy, then the per-epoch LR schedule's step."""
        test_loss, test_acc = mnist.evaluate(self.model, self.data.test)
        if self.cfg.lr_schedule == "step":
            self.scheduler.step()
        return {"test_loss": test_loss, "test_acc": test_acc}
