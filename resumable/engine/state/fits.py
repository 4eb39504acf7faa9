"""A checkpoint's payload checked against this run before anything is loaded: the loop position it holds is the one
its manifest claims, and its model and optimizer state have the live objects' structure. A payload that fails is an
invalid checkpoint (an older one may fit), and nothing was modified."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...checkpoint import InvalidCheckpoint
from ...checkpoint import format as fmt


def check_position(position: Any, manifest: dict[str, Any]) -> None:
    """The manifest must describe its payload: the step and data position it claims are the payload's own (a step
    folder copied under a newer step's name, its manifest re-sealed, is not that step: it would resume as the newer
    step and lose the steps between in every later session)."""
    if not isinstance(position, dict):
        raise InvalidCheckpoint(f"its payload's loop position is a {type(position).__name__}, not a record")
    differs = [key for key in fmt.POSITION if manifest.get(key) is not None and position.get(key) != manifest[key]]
    if differs:
        shown = lambda record: ", ".join(f"{key} {record.get(key)}" for key in differs)  # noqa: E731
        raise InvalidCheckpoint(f"its manifest says {shown(manifest)}, but its payload holds {shown(position)}: the "
                                f"manifest does not describe this payload (a folder copied or renamed?)")


def check_fits(objects: Mapping[str, Any], payload: dict[str, Any], frozen: set[str] | frozenset[str] = frozenset(),
               trainable_difference: Callable[[], str] = lambda: "") -> None:
    """The saved model and optimizer state must have the live objects' structure: the model's keys (less the
    ``frozen`` ones, not stored), shapes and dtypes, the optimizer's parameter groups and their sizes.
    Otherwise this checkpoint is invalid (raised before anything is modified; an older one may fit).
    ``trainable_difference``: how the parameters' requires_grad differ from the checkpoint's, said when the optimizer
    does not fit (a LoRA run resumed with other target modules)."""
    model, saved = objects["model"], payload["model"]
    if isinstance(model, torch.nn.Module):
        live = model.state_dict()
        if not isinstance(saved, dict):
            raise InvalidCheckpoint(f"its model state is a {type(saved).__name__}: it does not fit this model")
        missing, extra = sorted(set(live) - set(saved) - frozen), sorted(set(saved) - set(live))
        if missing or extra:
            raise InvalidCheckpoint(f"its model state does not fit this model (missing {missing[:3]}, "
                                    f"unexpected {extra[:3]})")
        for key, tensor in live.items():
            if key in frozen and key not in saved:
                continue
            other = saved[key]
            if not isinstance(other, torch.Tensor) or (other.shape, other.dtype) != (tensor.shape, tensor.dtype):
                found = (f"{tuple(other.shape)} {other.dtype}" if isinstance(other, torch.Tensor)
                         else type(other).__name__)
                raise InvalidCheckpoint(f"its model state does not fit this model ({key}: checkpoint {found}, "
                                        f"this model {tuple(tensor.shape)} {tensor.dtype})")
    optimizer, saved_opt = objects["optimizer"], payload["optimizer"]
    groups = getattr(optimizer, "param_groups", None)
    if isinstance(groups, list) and isinstance(saved_opt, dict):
        saved_groups = saved_opt.get("param_groups")
        sizes = [len(g["params"]) for g in groups]
        if not isinstance(saved_groups, list) or [len(g.get("params", ())) if isinstance(g, dict) else -1
                                                  for g in saved_groups] != sizes:
            flags = trainable_difference()
            raise InvalidCheckpoint(f"its optimizer state does not fit this optimizer (parameter groups of "
                                    f"sizes {sizes} here)" + (f"; requires_grad differs from the checkpoint "
                                    f"({flags}): build the optimizer over the parameters the run trained (the "
                                    f"same LoRA config and target_modules)" if flags else ""))
