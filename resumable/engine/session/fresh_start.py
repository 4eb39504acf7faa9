"""The same fresh start every time in one process (a notebook kernel).

A session that starts fresh trains the objects it was given. If it fails before its first checkpoint commits, those
objects are changed: weights trained a few steps, optimizer and scheduler state, RNG streams advanced. A notebook user
who fixes the loop and runs the Run and loop cells again would start "fresh" from the changed objects, unlike a clean
run. So the first fresh start on a run dir keeps what it was given -- a CPU copy of every object's state, the RNG
streams, the module modes, which parameters require grad -- until a checkpoint of that run dir commits; a later fresh
start on the same run dir with the *same* objects puts it back first. New objects (the model cell run again) are a
fresh start of their own.

The copy is taken in an interactive kernel, where cells are re-run, and only when it fits in a quarter of the
available host memory. Otherwise only the RNG streams, the modes and the parameters' version counters are kept: a
later fresh start on objects that an earlier try changed is refused, naming the fix, instead of training from them.
"""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...checkpoint.memory import proc_field
from ...errors import ResumableError
from ..state.train_state import capture_rng, restore_rng
from . import open_runs

COPY_FRACTION = 0.25  # the copy may take at most this share of the available host memory


@dataclass
class Kept:
    owners: dict[str, weakref.ref]  # object name -> the live object it was taken from
    states: dict[str, Any] | None  # object name -> a CPU copy of its state; None: too large, not copied
    rng: dict[str, Any]
    modes: list[bool]
    trainable: list[bool]  # each parameter's requires_grad (an earlier try may have unfrozen some)
    version: int  # the model's parameter and buffer versions, summed: changed in place since the start?


_KEPT: dict[str, Kept] = {}  # run dir key -> the state its first fresh start was given


def _version(model: torch.nn.Module) -> int:
    return sum(t._version for t in (*model.parameters(), *model.buffers()))


def _cpu_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        out = OrderedDict() if isinstance(value, OrderedDict) else {}
        for k, v in value.items():
            out[k] = _cpu_copy(v)
        if isinstance(out, OrderedDict) and hasattr(value, "_metadata"):  # module versions, for load_state_dict
            out._metadata = copy.deepcopy(value._metadata)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(v) for v in value)
    return copy.deepcopy(value)


def _size(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_size(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 0


def _ref(obj: Any) -> weakref.ref | None:
    try:
        return weakref.ref(obj)
    except TypeError:  # an object without weak references is never taken for the same one
        return None


def start_fresh(run_dir: str, objects: Mapping[str, tuple[Any, Any]], model: torch.nn.Module,
                keep_copy: bool) -> str | None:
    """At a fresh start on ``run_dir``: put back what its first fresh start in this process was given, when these
    are the same objects; otherwise keep what they hold now. ``objects``: name -> (the object as the user passed it,
    its Stateful). ``keep_copy``: copy the states (an interactive kernel). Returns a line for the log, or None."""
    key = open_runs.key(run_dir)
    kept = _KEPT.get(key)
    if kept is not None and kept.owners.get("model") is not None and kept.owners["model"]() is model:
        return _put_back(kept, objects, model)
    _KEPT[key] = _take(objects, model, keep_copy)
    return None


def _take(objects: Mapping[str, tuple[Any, Any]], model: torch.nn.Module, keep_copy: bool) -> Kept:
    owners = {name: ref for name, (given, _) in objects.items() if given is not None and (ref := _ref(given))}
    states = None
    if keep_copy:
        states = {name: stateful.state_dict() for name, (given, stateful) in objects.items()
                  if name in owners and stateful is not None}
        available = proc_field("/proc/meminfo", "MemAvailable")
        if available is not None and _size(states) > COPY_FRACTION * available:
            states = None
        else:
            states = _cpu_copy(states)
    return Kept(owners, states, capture_rng(), [m.training for m in model.modules()],
                [p.requires_grad for p in model.parameters()], _version(model))


def _put_back(kept: Kept, objects: Mapping[str, tuple[Any, Any]], model: torch.nn.Module) -> str | None:
    changed = _version(model) != kept.version
    if kept.states is None:
        if changed:
            raise ResumableError("this model was trained by an earlier try in this process that stopped before its "
                                 "first checkpoint, so a fresh start from it would not be the run's fresh start (its "
                                 "state was too large to keep a copy). Run the cell that builds the model and "
                                 "optimizer again, then the Run and the loop")
        restore_rng(kept.rng)
        return None
    restored = []
    for name, (given, stateful) in objects.items():
        owner = kept.owners.get(name)
        if owner is not None and owner() is given and name in kept.states and stateful is not None:
            stateful.load_state_dict(_cpu_copy(kept.states[name]))
            restored.append(name)
    modules, parameters = list(model.modules()), list(model.parameters())
    if len(modules) == len(kept.modes):
        for module, training in zip(modules, kept.modes, strict=True):
            module.training = training
    if len(parameters) == len(kept.trainable):
        for parameter, trainable in zip(parameters, kept.trainable, strict=True):
            parameter.requires_grad_(trainable)
    restore_rng(kept.rng)
    kept.version = _version(model)
    if not changed:
        return None
    names = ", ".join([*restored, "RNG streams"])
    return (f"starting fresh from the state this run dir's first fresh start in this process was given ({names}): an "
            f"earlier try trained these objects and stopped before its first checkpoint")


def forget(run_dir: str) -> None:
    """A checkpoint of ``run_dir`` committed (or a session resumed from one): its fresh start is on disk now."""
    _KEPT.pop(open_runs.key(run_dir), None)
