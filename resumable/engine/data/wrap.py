"""What ``Run(data=...)`` was given, turned into the source of its batches and what orders them."""

from __future__ import annotations

from typing import Any

from ...distributed import Distributed
from .sampler import ResumableSampler
from .sources import IndexBatches, LoaderBatches
from .stream import is_stream, stream_source
from .user_order import UserOrder


def as_source(data: Any, loader_options: dict[str, Any], batch_size: int, seed: int, shuffle: bool, drop_last: bool,
              dist: Distributed, allow_size_change: bool = False, sampler: Any = None, batch_sampler: Any = None
              ) -> tuple[Any, Any, int | None]:
    """``(source, sampler, num_samples)`` for ``Run(data=...)``: the batches' source and what orders them (the
    same object for a stream, whose number of samples is not known: None). ``allow_size_change``: a resume may find
    the dataset grown or shrunk (Session(allow_data_change=True)). ``sampler``/``batch_sampler``: the user's own
    order of a map-style dataset (``Loader(sampler=...)``, user_order.py) instead of resumable's."""
    user = sampler if sampler is not None else batch_sampler
    if isinstance(data, IndexBatches):
        source, size = data, data.size
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__") and not is_stream(data):
        source, size = LoaderBatches(data, **loader_options), len(data)
    elif is_stream(data):
        if user is not None:
            raise ValueError("Loader(sampler=...) and Loader(batch_sampler=...) order a map-style dataset (with "
                             "__getitem__ and __len__); iterable data comes in its own order: leave them out")
        if dist.world_size > 1:
            raise ValueError("iterable data under torchrun is not supported yet (each rank's stream position would "
                             "need its own entry): use a map-style dataset, or train in one process")
        stream = stream_source(data, batch_size, seed, drop_last, loader_options)
        return stream, stream, None
    else:
        raise TypeError(f"data must be a map-style Dataset (with __getitem__ and __len__), an iterable (an "
                        f"IterableDataset, a stateful loader) or resumable.IndexBatches, not {type(data).__name__}")
    if user is not None:
        return source, UserOrder(user, batch_sampler is not None, size, batch_size, seed, drop_last, dist.world_size,
                                 allow_size_change), size
    return source, ResumableSampler(size, batch_size, seed, shuffle=shuffle, drop_last=drop_last, rank=dist.rank,
                                    world_size=dist.world_size, allow_size_change=allow_size_change), size
