"""The user's ``evaluate()``, run between steps without changing the training run: every module's train/eval mode
is as it was before (an evaluate that leaves the model in eval mode would otherwise train on without dropout)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def evaluator(evaluate: Callable[[], Mapping[str, float]] | None,
              model: torch.nn.Module) -> Callable[[int], dict[str, float]]:
    """What the loop calls at an epoch's end (with the epoch): ``evaluate``'s metrics as floats ({} without one)."""

    def end_epoch(epoch: int) -> dict[str, float]:
        if evaluate is None:
            return {}
        modes = [(m, m.training) for m in model.modules()]
        try:
            return {k: float(v) for k, v in dict(evaluate()).items()}
        finally:
            for module, training in modes:
                module.training = training

    return end_epoch
