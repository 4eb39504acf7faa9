"""Walking a state tree (nested dicts, lists, tuples) by the structural path of each leaf.

A path is a tuple of the real keys and indices (``("optimizer", "state", 0, "exp_avg")``), so ``{0: a}`` and
``{"0": b}``, or a key containing ``/``, never collide. Rebuilding keeps each container's type and attributes:
an ``OrderedDict`` keeps the ``_metadata`` that ``Module.load_state_dict`` reads, a named tuple its class.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch

Path = tuple[Any, ...]


def map_leaves(obj: Any, fn: Callable[[Path, Any], Any], path: Path = ()) -> Any:
    """``obj`` rebuilt with every leaf (anything not a dict, list or tuple) replaced by ``fn(path, leaf)``."""
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: map_leaves(v, fn, (*path, k)) for k, v in obj.items()}
        result = copy.copy(obj)  # OrderedDict keeps _metadata, defaultdict its factory
        for k, v in obj.items():
            result[k] = map_leaves(v, fn, (*path, k))
        return result
    if isinstance(obj, list):
        return [map_leaves(v, fn, (*path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [map_leaves(v, fn, (*path, i)) for i, v in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return fn(path, obj)


def map_tensors(obj: Any, fn: Callable[[Path, torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor replaced by ``fn(path, tensor)``; other leaves stay as they are."""
    return map_leaves(obj, lambda path, leaf: fn(path, leaf) if isinstance(leaf, torch.Tensor) else leaf)


def tensors(obj: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """Every tensor in ``obj`` with its path, in the tree's own order (dict insertion order)."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from tensors(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from tensors(value, (*path, index))


def path_text(path: Path) -> str:
    """A path as the fingerprint and messages write it: ``/optimizer/state/0/exp_avg``."""
    return "".join(f"/{part}" for part in path)
