"""What a session trains to (the plan), how it ended (the outcome), and the running averages of a step and an
evaluation that its budget decisions use."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..state.train_state import TrainState


@dataclass(frozen=True)
class LoopPlan:
    """What a session trains to: ``epochs`` or ``max_steps``, and how it logs, meets a failed save and steps."""

    epochs: int
    max_steps: int | None = None
    log_every: int = 10
    on_save_error: str = "warn"  # "warn": keep training and retry at the next trigger; "stop": exit 75
    accumulate: int = 1  # micro-batches per optimizer step

    def done(self, state: TrainState) -> bool:
        """Whether the run is complete at ``state``: every epoch trained, or ``max_steps`` reached."""
        return state.epoch >= self.epochs or (self.max_steps is not None and state.step >= self.max_steps)

    def steps_per_epoch(self, sampler: Any) -> int | None:
        """Optimizer steps an epoch of ``sampler`` (None: a stream whose length is not known yet)."""
        batches = sampler.batches_per_epoch
        return None if batches is None else math.ceil(batches / self.accumulate)

    def total_steps(self, sampler: Any) -> int | None:
        """Steps of the whole run (None: not known, for a stream without max_steps before its first epoch ends)."""
        per_epoch = self.steps_per_epoch(sampler)
        planned = None if per_epoch is None else self.epochs * per_epoch
        if self.max_steps is None:
            return planned
        return self.max_steps if planned is None else min(planned, self.max_steps)


@dataclass
class Outcome:
    """How a session ended: the run is complete, or why it stopped early with its state committed."""

    finished: bool
    reason: str  # "finished", or why it stopped early: a signal name, "time limit", "save error", "save stuck",
    # "lock lost"


class Estimate:
    """Exponential moving average of a duration, for budget decisions."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.value = 0.0

    def add(self, seconds: float) -> None:
        self.value = seconds if self.value == 0.0 else self.alpha * seconds + (1 - self.alpha) * self.value
