"""More sources of batches than the Run's ``data``: a GAN's latent codes or second image set, a distillation set, the
tasks of a multi-task loop. ``run.loader("codes", dataset, batch_size=64)`` declares one before the loop; inside it
``next(codes)`` gives its next batch. Each source has its own order (a :class:`ResumableSampler` seeded from the Run's
seed and its name), starts its next epoch when its data runs out, and its position (epoch, batch) is checkpointed with
the Run: a resume continues every source at the batch after the last one the checkpoint's step drew, in O(1), as for
``data``.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from ...distributed import Distributed
from .sampler import ResumableSampler, epoch_seed
from .sources import IndexBatches, LoaderBatches

PREFIX = "loader:"  # the checkpoint entry of a source: "loader:noise"


def source_seed(seed: int, name: str) -> int:
    """The seed of source ``name``'s order: the Run's seed mixed with the name, so each source draws its own order."""
    return epoch_seed(seed, zlib.crc32(name.encode("utf-8")))


class MoreBatches:
    """One declared source: an endless iterator of its batches (see the module docstring) and a ``Stateful``."""

    def __init__(self, name: str, data: Any, batch_size: int, seed: int, shuffle: bool, drop_last: bool,
                 loader_options: dict[str, Any], dist: Distributed, device: torch.device | None = None) -> None:
        if isinstance(data, IndexBatches):
            self.source: Any = data
            size = data.size
        elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
            self.source, size = LoaderBatches(data, **loader_options), len(data)
        else:
            raise TypeError(f"run.loader({name!r}, ...) takes a map-style Dataset (with __getitem__ and __len__) or "
                            f"resumable.IndexBatches, not {type(data).__name__}: iterable data is the Run's data= only")
        self.name = name
        self.device = device if isinstance(data, IndexBatches) else None  # IndexBatches takes indices on the device
        self.sampler = ResumableSampler(size, batch_size, source_seed(seed, name), shuffle=shuffle,
                                        drop_last=drop_last, rank=dist.rank, world_size=dist.world_size)
        self.epoch, self.batch = 0, 0  # the next batch ``next()`` gives
        self._fetch: Any = None  # the source's fetch for ``_at``, while it walks on from there
        self._at: tuple[int, int] | None = None
        self._order: tuple[int, torch.Tensor] | None = None

    def __iter__(self) -> MoreBatches:
        return self

    def __next__(self) -> Any:
        if self.batch >= self.sampler.batches_in(self.epoch):  # its data ran out: its next epoch, a new order
            self.epoch, self.batch = self.epoch + 1, 0
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, self.sampler.epoch_order(self.epoch))
        if self._at != (self.epoch, self.batch):  # first use, a new epoch or a resume: the loader starts here
            self._fetch = self.source.epoch(self.sampler, self.epoch, self.batch)
        indices = self.sampler.batch(self._order[1], self.batch, self.epoch)
        batch = self._fetch(indices.to(self.device) if self.device is not None else indices)
        self.batch += 1
        self._at = (self.epoch, self.batch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch, "order": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            self.sampler.load_state_dict(state["order"])
        except ValueError as e:
            raise ValueError(f"run.loader({self.name!r}): {e}") from None
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self.close()  # a loader already started walks from elsewhere

    def close(self) -> None:
        """End its loader's workers (the session ends; the next ``next()`` starts a loader again)."""
        self.source.close()
        self._fetch, self._at = None, None
