"""Resumable index sampler: the order of an epoch is a pure function of (seed, epoch).

Resuming at batch ``k`` regenerates that epoch's permutation (one ``randperm``) and starts at ``k``:
no batch is loaded or computed to skip ahead, so a resume costs O(1) batches whatever the position.
The sampler uses its own ``torch.Generator`` and never touches the global RNG streams, so dropout and
augmentation randomness are independent of the data order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ... import log

_MASK63 = (1 << 63) - 1


def epoch_seed(seed: int, epoch: int) -> int:
    """Mix (seed, epoch) into one 63-bit generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


class ResumableSampler:
    """Batches of dataset indices, shuffled per epoch, addressable by (epoch, batch).

    >>> s = ResumableSampler(num_samples=10, batch_size=4, seed=0)
    >>> s.batches_per_epoch
    3
    >>> order = s.epoch_order(0)
    >>> torch.equal(torch.cat([s.batch(order, k) for k in range(3)]).sort().values, torch.arange(10))
    True
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int, shuffle: bool = True,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1,
                 allow_size_change: bool = False) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be at least 1")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.allow_size_change = allow_size_change  # Session(allow_data_change=True)
        # Samples of epoch ``offset[0]`` trained before its batch 0: a resume at another world size starts the rest of
        # that epoch there, at the exact sample (engine/state/remap.py); every other epoch starts at its first sample.
        self.offset: tuple[int, int] | None = None
        self._told = False  # the trailing samples that no step takes are announced once
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its order on CPU), for upcoming()
        if self.batches_per_epoch < 1:
            raise ValueError(f"num_samples={num_samples} is too few for {world_size} processes: each rank needs at "
                             f"least {self.min_rank_batch} sample(s) per step; use fewer processes or more data")

    @property
    def global_batch(self) -> int:
        """Samples per step over all ranks (``batch_size`` per rank)."""
        return self.batch_size * self.world_size

    @property
    def min_rank_batch(self) -> int:
        """The fewest samples a rank may get in the short last step of an epoch: an empty batch gives a NaN
        loss, and a 1-sample batch makes BatchNorm fail in train mode (unless every batch is that small)."""
        return min(2, self.batch_size)

    def _short_step(self, count: int) -> int:
        """Samples of the short last step of ``count`` samples (0: none)."""
        full, rest = divmod(count, self.global_batch)
        if rest == 0 or (self.drop_last and full > 0):
            return 0
        return rest

    def _dropped(self, count: int) -> int:
        short = self._short_step(count)
        return short if self.world_size > 1 and 0 < short < self.min_rank_batch * self.world_size else 0

    def _batches(self, count: int) -> int:
        return count // self.global_batch + (1 if self._short_step(count) and not self._dropped(count) else 0)

    @property
    def dropped_per_epoch(self) -> int:
        """Trailing samples of each epoch that no step takes (DDP only): a short last step that would leave
        some rank fewer than :attr:`min_rank_batch` samples is not taken. A single process takes every
        sample (``drop_last=False``)."""
        return self._dropped(self.num_samples)

    @property
    def batches_per_epoch(self) -> int:
        """Steps of a whole epoch; under DDP each step is one ``batch_size`` slice per rank."""
        return self._batches(self.num_samples)

    def start_of(self, epoch: int) -> int:
        """The sample of ``epoch``'s order its batch 0 starts at (0 unless a resume at another world size set it)."""
        return self.offset[1] if self.offset is not None and self.offset[0] == epoch else 0

    def batches_in(self, epoch: int) -> int:
        """Steps of ``epoch``: :attr:`batches_per_epoch`, or those of the rest of it after :meth:`start_of`."""
        start = self.start_of(epoch)
        return self._batches(self.num_samples - start) if start else self.batches_per_epoch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of dataset indices for ``epoch`` (int64, on CPU)."""
        dropped = self.dropped_per_epoch
        if dropped and not self._told:
            self._told = True
            log.warning(f"{self.num_samples} samples in steps of {self.batch_size} x {self.world_size} processes "
                        f"leave a last step of {dropped} sample(s), which would give a rank fewer than "
                        f"{self.min_rank_batch}: those {dropped} trailing sample(s) of each epoch's order are "
                        f"skipped (each epoch trains {self.num_samples - dropped}). Choose a batch size that leaves "
                        f"at least {self.min_rank_batch * self.world_size} for the last step to use them all")
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator()
        generator.manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=generator)

    def batch(self, order: torch.Tensor, index: int, epoch: int | None = None) -> torch.Tensor:
        """This rank's indices of batch ``index`` of ``epoch``, whose order is ``order``.

        Under DDP step ``index`` covers ``order[s + index * B * W : s + (index + 1) * B * W]`` (``s``: the epoch's
        :meth:`start_of`, 0 but after a resume at another world size) and rank ``r`` takes the r-th slice of B, so
        the ranks' slices, concatenated in rank order, are the single-process order. A short last step is split as
        evenly as possible (no sample twice); it is not taken at all when that would leave a rank fewer than
        :attr:`min_rank_batch` samples (see :attr:`dropped_per_epoch`).
        """
        batches = self.batches_in(epoch) if epoch is not None else self.batches_per_epoch
        if not 0 <= index < batches:
            raise IndexError(f"batch {index} is outside 0..{batches - 1}")
        start = (self.start_of(epoch) if epoch is not None else 0) + index * self.global_batch
        chunk = order[start:start + self.global_batch]
        if self.world_size == 1:
            return chunk
        if len(chunk) == self.global_batch:
            return chunk[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        return torch.tensor_split(chunk, self.world_size)[self.rank]

    def walk(self, epoch: int, first: int, device: torch.device | None = None
             ) -> Iterator[tuple[int, torch.Tensor, int, bool]]:
        """``(index, indices, size, last)`` for batches ``first..`` of ``epoch``: what the loop trains (indices on
        ``device``), how many samples, and whether it is the epoch's last batch."""
        order = self.epoch_order(epoch)
        self._order = (epoch, order)
        order = order.to(device) if device is not None else order
        batches = self.batches_in(epoch)
        for index in range(first, batches):
            indices = self.batch(order, index, epoch)
            yield index, indices, len(indices), index + 1 == batches

    def upcoming(self, epoch: int, index: int) -> tuple[str, torch.Tensor] | None:
        """What batch ``index`` of ``epoch`` is made of, for a checkpoint's record (engine/data/content_check.py): its
        sample indices, without loading anything."""
        if not 0 <= index < self.batches_in(epoch):
            return None
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, self.epoch_order(epoch))
        return "sample indices", self.batch(self._order[1], index, epoch)

    def epoch_done(self, epoch: int, batch_in_epoch: int) -> bool:
        """Whether every batch of ``epoch`` was trained when ``batch_in_epoch`` batches are."""
        return batch_in_epoch >= self.batches_in(epoch)

    def state_dict(self) -> dict[str, Any]:
        # Position lives in TrainState; this records the identity of the order so a resume can
        # refuse a checkpoint whose order would differ, and where a remapped epoch starts.
        return {"num_samples": self.num_samples, "batch_size": self.batch_size, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last,
                **({"offset": list(self.offset)} if self.offset is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(state, dict) and "user_sampler" in state:
            raise ValueError(f"the checkpoint was written with your own {state.get('type')!r} as the Loader's "
                             f"{'batch_sampler' if state.get('batched') else 'sampler'}, this run orders the data with "
                             f"resumable's sampler: pass the same one again (resumable.Loader(sampler=...)), or start "
                             f"over with --fresh --overwrite")
        mine = {k: v for k, v in self.state_dict().items() if k != "offset"}
        if self.allow_size_change:  # Run(allow_data_change=True): checked at an epoch boundary by the Run
            mine.pop("num_samples")
        diffs = [f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in mine.items() if state.get(k) != v]
        if diffs:
            raise ValueError("the data order of this run differs from the checkpoint's (" + "; ".join(diffs)
                             + "); use the same data and options, or start over with --fresh --overwrite")
        offset = state.get("offset")
        valid = isinstance(offset, (list, tuple)) and len(offset) == 2 and all(isinstance(v, int) for v in offset)
        self.offset = (offset[0], offset[1]) if valid else None
