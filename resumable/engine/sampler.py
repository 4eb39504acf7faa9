"""Resumable index sampler: the order of an epoch is a pure function of (seed, epoch).

Resuming at batch ``k`` regenerates that epoch's permutation (one ``randperm``) and starts at ``k``:
no batch is loaded or computed to skip ahead, so a resume costs O(1) batches whatever the position.
The sampler uses its own ``torch.Generator`` and never touches the global RNG streams, so dropout and
augmentation randomness are independent of the data order.
"""

from __future__ import annotations

import math
from typing import Any

import torch

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
                 drop_last: bool = False, rank: int = 0, world_size: int = 1) -> None:
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

    @property
    def global_batch(self) -> int:
        """Samples per step over all ranks (``batch_size`` per rank)."""
        return self.batch_size * self.world_size

    @property
    def batches_per_epoch(self) -> int:
        """Steps per epoch; under DDP each step is one ``batch_size`` slice per rank."""
        if self.drop_last:
            return max(self.num_samples // self.global_batch, 1)
        return math.ceil(self.num_samples / self.global_batch)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of dataset indices for ``epoch`` (int64, on CPU)."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator()
        generator.manual_seed(epoch_seed(self.seed, epoch))
        return torch.randperm(self.num_samples, generator=generator)

    def batch(self, order: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's indices of batch ``index`` of an epoch whose order is ``order``.

        Under DDP step ``index`` covers ``order[index * B * W : (index + 1) * B * W]`` and rank ``r`` takes
        the r-th slice of B, so the ranks' slices, concatenated in rank order, are the single-process order.
        A short last step is split as evenly as possible (no sample twice, none dropped).
        """
        if not 0 <= index < self.batches_per_epoch:
            raise IndexError(f"batch {index} is outside 0..{self.batches_per_epoch - 1}")
        start = index * self.global_batch
        chunk = order[start:start + self.global_batch]
        if self.world_size == 1:
            return chunk
        if len(chunk) == self.global_batch:
            return chunk[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        return torch.tensor_split(chunk, self.world_size)[self.rank]

    def state_dict(self) -> dict[str, Any]:
        # Position lives in TrainState; this records the identity of the order so a resume can
        # refuse a checkpoint whose order would differ.
        return {"num_samples": self.num_samples, "batch_size": self.batch_size, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        diffs = [f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in mine.items() if state.get(k) != v]
        if diffs:
            raise ValueError("the data order of this run differs from the checkpoint's (" + "; ".join(diffs)
                             + "); use the same data and options, or start over with --fresh --overwrite")
