"""The arguments of :class:`~resumable.engine.run.Run` turned into the engine's parts: the module to
checkpoint, the data source, the config as JSON records it, the budget and the save triggers."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import torch

from .. import log
from ..config import RunOptions, format_duration, parse_duration
from ..distributed import Distributed
from ..platforms import COLAB_LIFETIME_ENV, COLAB_SAFETY_S, colab_default_limit_s, colab_vm_lifetime_s
from .data.sampler import ResumableSampler
from .data.sources import IndexBatches, LoaderBatches
from .data.stream import is_stream, stream_source
from .loop.preemption import Budget, process_age_s
from .loop.triggers import SaveTriggers


def plain_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose state dict is checkpointed: inside ``torch.compile`` (``_orig_mod``) and
    ``DistributedDataParallel`` (``module``) wrappers, so keys carry no prefix and a checkpoint loads into the
    plain model, with or without those wrappers, on any number of GPUs."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def json_value(value: Any, where: str) -> Any:
    """``value`` as it comes back from JSON (tuples become lists, keys strings), so what is compared on resume
    is what was recorded; a value JSON cannot encode is refused now, naming where it is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise ValueError(f"{where} has a key {key!r} of type {type(key).__name__}; JSON keys are strings "
                                 f"(use str keys)")
            out[json.loads(json.dumps({key: None})).popitem()[0]] = json_value(item, f"{where}[{key!r}]")
        return out
    raise ValueError(f"{where} is a {type(value).__name__} ({value!r}), which JSON cannot record; pass a plain "
                     f"value instead (e.g. str({value!r}))")


def budget(options: RunOptions) -> Budget:
    start = time.monotonic() - process_age_s()
    if options.time_limit_s is not None:
        return Budget(options.time_limit_s, start=start)
    colab = colab_default_limit_s()
    if colab is None:
        return Budget(None)
    lifetime, source = colab_vm_lifetime_s()
    if colab <= 0:  # no floor: a step now would eat the margin kept for the last save before the VM goes
        log.warning(f"Colab VM: less than {format_duration(COLAB_SAFETY_S)} is left of its "
                    f"{format_duration(lifetime)} lifetime ({source}, counted from VM start): saving a checkpoint and "
                    f"stopping now, before any step. Continue on a fresh runtime, or set {COLAB_LIFETIME_ENV} (e.g. "
                    f"24h on Colab Pro) or --time-limit if this VM lives longer")
    else:
        log.info(f"Colab detected: stopping cleanly after {format_duration(colab)} (before the VM's "
                 f"{format_duration(lifetime)} lifetime, {source}, counted from VM start); pass --time-limit or set "
                 f"{COLAB_LIFETIME_ENV} to change it")
    return Budget(colab)


def triggers(options: RunOptions) -> SaveTriggers:
    if options.checkpoint_every == "auto":
        return SaveTriggers(options.checkpoint_steps, None, auto_mtbf_s=parse_duration(options.mtbf))
    return SaveTriggers(options.checkpoint_steps, options.checkpoint_every_s)


def as_source(data: Any, loader_options: dict[str, Any], batch_size: int, seed: int, shuffle: bool, drop_last: bool,
              dist: Distributed) -> tuple[Any, Any, int | None]:
    """``(source, sampler, num_samples)`` for ``Run(data=...)``: the batches' source and what orders them (the
    same object for a stream, whose number of samples is not known: None)."""
    if isinstance(data, IndexBatches):
        source, size = data, data.size
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__") and not is_stream(data):
        source, size = LoaderBatches(data, **loader_options), len(data)
    elif is_stream(data):
        if dist.world_size > 1:
            raise ValueError("iterable data under torchrun is not supported yet (each rank's stream position would "
                             "need its own entry): use a map-style dataset, or train in one process")
        stream = stream_source(data, batch_size, seed, drop_last, loader_options)
        return stream, stream, None
    else:
        raise TypeError(f"data must be a map-style Dataset (with __getitem__ and __len__), an iterable (an "
                        f"IterableDataset, a stateful loader) or resumable.IndexBatches, not {type(data).__name__}")
    return source, ResumableSampler(size, batch_size, seed, shuffle=shuffle, drop_last=drop_last, rank=dist.rank,
                                    world_size=dist.world_size), size


def device_of(model: torch.nn.Module) -> torch.device:
    parameter = next(iter(model.parameters()), None)
    return parameter.device if parameter is not None else torch.device("cpu")
