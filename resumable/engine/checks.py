"""Checks of a checkpoint's state against this run: it can be loaded back safely (before the first save), and it
was written for the same computation (before a resume)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConfigMismatch, StateNotLoadable

_PLACEHOLDER = torch.zeros(0)


def _skeleton(obj: Any) -> Any:
    """``obj`` with every tensor replaced by one tiny shared tensor: the structure, cheap to pickle."""
    if isinstance(obj, torch.Tensor):
        return _PLACEHOLDER
    if isinstance(obj, dict):
        return {k: _skeleton(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_skeleton(v) for v in obj]
    return obj


def check_loadable(name: str, state: Any) -> None:
    """Raise StateNotLoadable if ``state`` would commit but could never be loaded with weights_only."""
    buffer = io.BytesIO()
    try:
        torch.save(_skeleton(state), buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means the checkpoint could never be resumed
        detail = " ".join(str(e).split())[:300]
        raise StateNotLoadable(
            f"the state of {name!r} cannot be loaded back safely (weights_only): {detail}. Return only tensors, "
            f"numbers, strings, None and lists/dicts of them from its state_dict() (e.g. convert numpy values "
            f"with .item() or torch.from_numpy)") from e


def check_computation(saved: dict[str, Any], current: dict[str, Any], run_dir: str, api: bool,
                      ignore: frozenset[str] = frozenset(),
                      accept: Mapping[str, tuple[Any, Any]] | None = None) -> None:
    """Raise ConfigMismatch for the first field that differs; ``accept`` maps a field to the one change
    ``(checkpoint's, now)`` allowed on purpose (the bf16 -> fp16 switch of ``--amp auto``)."""
    for key in sorted((set(saved) | set(current)) - ignore):
        default = "none" if key == "amp" else None  # checkpoints from before --amp existed
        change = (saved.get(key, default), current.get(key, default))
        if accept and key in accept and change == tuple(accept[key]):
            continue
        if change[0] != change[1]:
            raise ConfigMismatch(key, saved.get(key, default), current.get(key, default), run_dir, api=api)
