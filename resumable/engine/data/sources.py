"""Where a run's batches come from, addressed by (epoch, batch index) so a resume starts anywhere in O(1).

Two sources share the :class:`~resumable.engine.data.sampler.ResumableSampler` order (or the user's own,
:class:`~resumable.engine.data.user_order.UserOrder`, which has the same interface):

* :class:`IndexBatches` calls ``fetch(indices)`` in the training process: the fast path for data that is
  already resident on the device (the built-in MNIST task).
* :class:`LoaderBatches` feeds a map-style ``Dataset`` through a normal ``DataLoader`` (workers, pinned
  memory, the user's ``collate_fn``), starting each epoch's batch sampler at the resumed batch.

Randomness inside ``Dataset.__getitem__`` (augmentations) is made a pure function of (seed, epoch, batch
index, rank): every batch is fetched with torch, ``random`` and NumPy seeded from :func:`batch_seed`, in
whichever worker loads it, so a mid-epoch resume reproduces the same augmentations whatever ``num_workers``
is, and DDP ranks draw different augmentations for their different samples. In the training process
(``num_workers=0``) only the CPU streams are seeded, and restored afterwards, so fetching never disturbs
training randomness: the CUDA generators are left alone unless CUDA is already initialised (then they are
saved and restored too), because ``torch.manual_seed`` would reseed every GPU for good (or, before CUDA
starts, queue a seed that lands on the GPUs later).
"""

from __future__ import annotations

import functools
import random
import signal
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from .sampler import ResumableSampler, epoch_seed

# Signals a worker leaves to the main process: a terminal's Ctrl-C (and a notebook's interrupt) reaches the whole
# process group, and a worker it killed would fail the main process's next batch instead of letting it stop cleanly.
# SIGTERM keeps its default, so that the DataLoader can still terminate a stuck worker.
WORKER_IGNORES = ("SIGINT", "SIGHUP")


def _start_worker(user_init: Callable[[int], None] | None, worker_id: int) -> None:
    for name in WORKER_IGNORES:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    if user_init is not None:
        user_init(worker_id)


def worker_options(options: dict[str, Any]) -> dict[str, Any]:
    """``DataLoader`` options whose workers (if any) ignore :data:`WORKER_IGNORES`, then run the user's
    ``worker_init_fn``; the main process stops, and shuts them down."""
    if not options.get("num_workers"):
        return options
    return {**options, "worker_init_fn": functools.partial(_start_worker, options.get("worker_init_fn"))}


def shut_down(iterator: Any) -> None:
    """End a ``DataLoader`` iterator's worker processes now (dropping it leaves that to garbage collection, which a
    traceback holding a frame can delay indefinitely)."""
    stop = getattr(iterator, "_shutdown_workers", None)
    if callable(stop):
        try:
            stop()
        except Exception:  # noqa: BLE001 - a worker that is already gone
            pass


def batch_seed(seed: int, epoch: int, index: int, rank: int = 0) -> int:
    """A 63-bit seed for batch ``index`` of ``epoch`` on DDP rank ``rank``, independent of which worker loads
    it. Rank 0's seeds are those of a single process, so adding ``torchrun`` changes no single-process run;
    every other rank mixes its rank in (the same seed on every rank would give the same augmentation
    decisions, e.g. the same crops and flips, to every rank's batch)."""
    mixed = epoch_seed(epoch_seed(seed, epoch), index)
    return mixed if rank == 0 else epoch_seed(mixed, rank)


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
        self._streams = ExitStack()

    def __enter__(self) -> None:
        if get_worker_info() is not None:  # a DataLoader worker: its streams are its own, seed them all
            torch.manual_seed(self.seed)
        else:  # the training process: its streams must come back untouched
            self.saved = (torch.default_generator.get_state(), random.getstate(), np.random.get_state())
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                self._streams.enter_context(torch.random.fork_rng(devices=range(torch.cuda.device_count()),
                                                                  device_type="cuda"))
                torch.cuda.manual_seed_all(self.seed)
            torch.default_generator.manual_seed(self.seed)
        random.seed(self.seed)
        np.random.seed(self.seed % (1 << 32))

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            self._streams.close()  # the CUDA generators, when they were forked
            torch.default_generator.set_state(self.saved[0])
            random.setstate(self.saved[1])
            np.random.set_state(self.saved[2])
            self.saved = None


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
    """The batches of epoch ``epoch`` from batch ``start`` on, as :class:`SeededBatch` lists, for ``DataLoader``;
    with ``through_epochs`` it goes on into the following epochs (one loader, persistent workers)."""

    def __init__(self, sampler: ResumableSampler, epoch: int, start: int, through_epochs: bool = False) -> None:
        self.sampler = sampler
        self.epoch = epoch
        self.start = start
        self.through_epochs = through_epochs

    def __len__(self) -> int:
        if self.through_epochs:
            raise TypeError("a batch sampler through every epoch has no length")
        return self.sampler.batches_in(self.epoch) - self.start

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.epoch, self.start
        while True:
            order = self.sampler.epoch_order(epoch)
            for index in range(start, self.sampler.batches_in(epoch)):
                seed = batch_seed(self.sampler.seed, epoch, index, self.sampler.rank)
                yield SeededBatch(self.sampler.batch(order, index, epoch).tolist(), seed)
            if not self.through_epochs:
                return
            epoch, start = epoch + 1, 0


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
    """Batches of a map-style dataset through ``DataLoader(**loader_options)``, one loader iterator per epoch
    (or, with ``persistent_workers=True``, one for the whole session, so the workers really persist).

    The loader gets a private ``generator`` seeded from (seed, epoch): a ``DataLoader`` iterator otherwise
    draws its workers' base seed from the global torch RNG, one draw per epoch *or resume*, which would
    shift every later random number of a resumed run.
    """

    def __init__(self, dataset: Dataset, **loader_options: Any) -> None:
        for reserved in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "generator"):
            if reserved in loader_options:
                fix = (f"pass your own as Loader({reserved}=...), which resumes it exactly" if "sampler" in reserved
                       else "leave it out of the loader options")
                raise ValueError(f"{reserved}= is decided by resumable in the loader options (it orders and batches "
                                 f"the data to resume at any batch); {fix}")
        self.dataset = SeededDataset(dataset)
        self.options = loader_options
        self.persistent = bool(loader_options.get("persistent_workers")) and loader_options.get("num_workers", 0) > 0
        self._iterator: Iterator[Any] | None = None
        self._next: tuple[int, int] | None = None  # (epoch, batch) the persistent iterator yields next

    def epoch(self, sampler: ResumableSampler, epoch: int, start: int) -> Callable[[torch.Tensor], Any]:
        if self.persistent and self._iterator is not None and self._next == (epoch, start):
            return self._fetch  # the session's loader goes on into this epoch with the same workers
        generator = torch.Generator()
        generator.manual_seed(epoch_seed(sampler.seed ^ 0x5EED, epoch))
        batches = EpochBatchSampler(sampler, epoch, start, through_epochs=self.persistent)
        shut_down(self._iterator)  # the previous epoch's workers, if it was left early
        self._iterator = iter(DataLoader(self.dataset, batch_sampler=batches, generator=generator,
                                         **worker_options(self.options)))
        self._next = (epoch, start)
        self._sampler = sampler
        return self._fetch

    def _fetch(self, _indices: torch.Tensor) -> Any:
        """The next batch: the loader walks the same order as the loop, in step."""
        batch = next(self._iterator)
        epoch, index = self._next
        self._next = (epoch, index + 1) if index + 1 < self._sampler.batches_in(epoch) else (epoch + 1, 0)
        return batch

    def close(self) -> None:
        shut_down(self._iterator)
        self._iterator = None
        self._next = None
