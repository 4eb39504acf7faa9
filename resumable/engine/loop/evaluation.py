"""The user's evaluation, run between steps without changing the training run.

Around ``evaluate()`` every module's train/eval mode is put back (an evaluate that leaves the model in eval mode
would otherwise train on without dropout) and so is every RNG stream the loop can touch (Python, NumPy, torch CPU,
and the CUDA devices once CUDA is initialised): an evaluation that samples, shuffles or applies dropout leaves the
next training batch exactly as it would have been without it. That is what lets a run evaluate on any schedule
(every N steps, at epoch ends) and resume between two evaluations bit-identically.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import numpy as np
import torch

from ... import log
from ...checkpoint.retention import BY_TEST_ACC, Best
from ..state.train_state import TrainState

Metrics = Callable[[], Mapping[str, float]]


class Evaluator:
    """When to evaluate (``every_steps``, ``at_epoch_end``) and the best checkpoint's bookkeeping (``best``)."""

    def __init__(self, fn: Metrics | None, model: torch.nn.Module, every_steps: int | None = None,
                 at_epoch_end: bool = True, best: Best = BY_TEST_ACC) -> None:
        self.fn = fn
        self.model = model
        self.every_steps = every_steps
        self.at_epoch_end = at_epoch_end
        self.best = best
        self._told_missing = False

    def due(self, step: int, epoch_end: bool) -> bool:
        """Whether to evaluate after optimizer step ``step`` (``epoch_end``: the epoch's last step)."""
        if self.fn is None:
            return False
        return (epoch_end and self.at_epoch_end) or (self.every_steps is not None and step % self.every_steps == 0)

    def __call__(self) -> dict[str, float]:
        """The user's metrics as floats ({} without an evaluation), the training run untouched."""
        if self.fn is None:
            return {}
        modes = [(m, m.training) for m in self.model.modules()]
        streams = (random.getstate(), np.random.get_state())
        devices = range(torch.cuda.device_count()) if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        try:
            with torch.random.fork_rng(devices=devices, device_type="cuda"):
                return {k: float(v) for k, v in dict(self.fn()).items()}
        finally:
            random.setstate(streams[0])
            np.random.set_state(streams[1])
            for module, training in modes:
                module.training = training

    def record_best(self, state: TrainState, metrics: Mapping[str, float]) -> None:
        """Note ``metrics`` of ``state.step`` in ``state`` if they are the best so far by :attr:`best`."""
        if state.best_metric != self.best.key:  # a resume that monitors another metric: its best starts afresh
            state.best_metric, state.best_value, state.best_step = self.best.key, None, None
        value = self.best.value(metrics)
        if value is None:
            if metrics and not self._told_missing and self.best.monitor not in metrics:
                self._told_missing = True
                log.warning(f"evaluate() returned {sorted(metrics)} without {self.best.monitor!r}, the metric that "
                            f"picks the best checkpoint: none is kept as best. Return it, or pass "
                            f"Evaluation(fn, monitor=...) naming one of these")
            return
        if self.best.better(value, state.best_value):
            state.best_value, state.best_step = value, state.step
