"""Where a run's batches come from, addressed by (epoch, batch index) so a resume starts anywhere in O(1).

Two sources share the :class:`~resumable.engine.sampler.ResumableSampler` order:

* :class:`IndexBatches` calls ``fetch(indices)`` in the training process: the fast path for data that is
  already resident on the device (the built-in MNIST task).
* :class:`LoaderBatches` feeds a map-style ``Dataset`` through a normal ``DataLoader`` (workers, pinned
  memory, the user's ``collate_fn``), starting each epoch's batch sampler at the resumed batch.

Randomness inside ``Dataset.__getitem__`` (augmentations) is made a pure function of (seed, epoch, batch
index): every batch is fetched with torch, ``random`` and NumPy seeded from :func:`batch_seed`, in whichever
worker loads it, so a mid-epoch resume reproduces the same augmentations whatever ``num_workers`` is. In the
training process the global streams are restored afterwards, so fetching never disturbs training randomness.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from .sampler import ResumableSampler, epoch_seed


def batch_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for batch ``index`` of ``epoch``, independent of which worker loads it."""
    return epoch_seed(epoch_seed(seed, epoch), index)


class SeededBatch(list):
    """A batch of dataset indices that carries the seed its items are fetched with."""

    def __init__(self, indices: list[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed

    def __reduce__(self):  # noqa: ANN204 - pickled to DataLoader workers with its seed
        return SeededBatch, (list(self), self.seed)


class _Seeded:
    """Seeds torch, random and NumPy for one fetch; in the training process restores them afterwards."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.saved: tuple[Any, ...] | None = None

    def __enter__(self) -> None:
        if get_worker_info() is None:  # the training process: its streams must come back untouched
            self.saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        np.random.seed(self.seed % (1 << 32))

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            torch.set_rng_state(self.saved[0])
            random.setstate(self.saved[1])
            np.random.set_state(self.saved[2])


class SeededDataset(Dataset):
    """Wraps a map-style dataset so each batch is fetched under its own seed (see the module doc)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: list[int]) -> list[Any]:
        seed = batch.seed if isinstance(batch, SeededBatch) else None
        if seed is None:
            return [self.dataset[i] for i in batch]
        with _Seeded(seed):
            return [self.dataset[i] for i in batch]


class EpochBatchSampler(Sampler[list[int]]):
    """The batches of one epoch from ``start`` on, as :class:`SeededBatch` lists, for ``DataLoader``."""

    def __init__(self, sampler: ResumableSampler, epoch: int, start: int) -> None:
        self.sampler = sampler
        self.epoch = epoch
        self.start = start

    def __len__(self) -> int:
        return self.sampler.batches_per_epoch - self.start

    def __iter__(self) -> Iterator[list[int]]:
        order = self.sampler.epoch_order(self.epoch)
        for index in range(self.start, self.sampler.batches_per_epoch):
            seed = batch_seed(self.sampler.seed, self.epoch, index)
            yield SeededBatch(self.sampler.batch(order, index).tolist(), seed)


class IndexBatches:
    """Batches made by ``fetch(indices)`` in the training process, for ``size`` samples held in memory
    (indices come on the run's device)."""

    def __init__(self, fetch: Callable[[torch.Tensor], Any], size: int) -> None:
        self.fetch = fetch
        self.size = size

    def epoch(self, sampler: ResumableSampler, epoch: int, start: int) -> Callable[[torch.Tensor], Any]:
        return self.fetch

    def close(self) -> None:
        pass


class LoaderBatches:
    """Batches of a map-style dataset through ``DataLoader(**loader_options)``, one loader iterator per epoch.

    The loader gets a private ``generator`` seeded from (seed, epoch): a ``DataLoader`` iterator otherwise
    draws its workers' base seed from the global torch RNG, one draw per epoch *or resume*, which would
    shift every later random number of a resumed run.
    """

    def __init__(self, dataset: Dataset, **loader_options: Any) -> None:
        for reserved in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "generator"):
            if reserved in loader_options:
                raise ValueError(f"{reserved}= is decided by resumable (its sampler orders and batches the data); "
                                 f"leave it out of the loader options")
        self.dataset = SeededDataset(dataset)
        self.options = loader_options
        self._iterator: Iterator[Any] | None = None

    def epoch(self, sampler: ResumableSampler, epoch: int, start: int) -> Callable[[torch.Tensor], Any]:
        generator = torch.Generator()
        generator.manual_seed(epoch_seed(sampler.seed ^ 0x5EED, epoch))
        loader = DataLoader(self.dataset, batch_sampler=EpochBatchSampler(sampler, epoch, start),
                            generator=generator, **self.options)
        self._iterator = iter(loader)
        iterator = self._iterator
        return lambda _indices: next(iterator)  # the loader walks the same order as the loop, in step

    def close(self) -> None:
        self._iterator = None  # shuts the epoch's workers down
