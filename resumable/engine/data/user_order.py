"""A map-style dataset ordered by the user's own sampler or batch sampler (``Loader(sampler=...)`` or
``Loader(batch_sampler=...)``), addressed by (epoch, batch) like
:class:`~resumable.engine.data.sampler.ResumableSampler`.

Each epoch's batches of indices are made at once from the user's sampler (no data is loaded for that), and a resume
starts that list at the saved batch. How the list of epoch ``E`` is made again after a resume depends on what the
sampler offers, decided when the Run is built (:func:`kind_of`):

1. ``state_dict``/``load_state_dict`` on the sampler or on its iterator (torchdata's protocol): its state at the start
   of each epoch is checkpointed; a resume loads it and makes that epoch again: O(1) epochs.
2. ``set_epoch`` and/or a ``torch.Generator`` in ``.generator`` (for a batch sampler also on its ``.sampler``): the
   Run calls ``set_epoch(epoch)`` and seeds the generator from (seed, epoch) before each epoch: a pure function of
   (seed, epoch), so a resume makes epoch ``E`` directly: O(1).
3. Anything else with ``__len__``: replayed, a resume iterates the freshly built sampler through the earlier epochs
   (the cost is said once).

Every epoch is made inside a fork of torch's CPU (and, once initialised, CUDA), ``random`` and NumPy's global streams
seeded from (seed, epoch), so a sampler that draws from them is deterministic and never disturbs training randomness.
The first batch after a resume is compared with the checkpoint's record of its indices (content_check.py): a replay
that is not exact stops the run before anything is trained.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import torch

from ... import log
from .sampler import epoch_seed
from .sources import _Seeded

STATEFUL, SEEDED, REPLAYED = "state_dict", "seeded", "replayed"
_FORK = 0x5A3F1E  # mixed into the seed of the global streams' fork, apart from the user's generator's seed
_KEPT = 3  # epochs of batches kept in memory (a persistent loader prefetches into the next epoch)


def _has(obj: Any, *names: str) -> bool:
    return all(callable(getattr(obj, name, None)) for name in names)


def _generator_of(user: Any, batched: bool) -> torch.Generator | None:
    for owner in (user, getattr(user, "sampler", None) if batched else None):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator):
            return generator
    return None


def _set_epoch_of(user: Any, batched: bool) -> Any:
    for owner in (user, getattr(user, "sampler", None) if batched else None):
        if owner is not None and _has(owner, "set_epoch"):
            return owner.set_epoch
    return None


def kind_of(user: Any, batched: bool, seed: int) -> tuple[str, bool]:
    """``(kind, on_iterator)``: how ``user`` is resumed (see the module doc); ``on_iterator``: kind 1 through the state
    of the sampler's iterator. The iterator is looked at (made once, inside a fork of the global streams) only when
    the sampler itself offers nothing: every session of a run makes it the same way, so a replay stays exact."""
    if _has(user, "state_dict", "load_state_dict"):
        return STATEFUL, False
    if _set_epoch_of(user, batched) is not None or _generator_of(user, batched) is not None:
        return SEEDED, False
    with _Seeded(epoch_seed(seed ^ _FORK, -1)):
        probe = iter(user)
    return (STATEFUL, True) if _has(probe, "state_dict", "load_state_dict") else (REPLAYED, False)


def _as_indices(items: Any, what: str) -> torch.Tensor:
    try:
        if isinstance(items, torch.Tensor):
            return items.detach().to("cpu", torch.int64).reshape(-1)
        return torch.tensor([int(i) for i in items], dtype=torch.int64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must yield dataset indices (ints), not {items!r:.80}") from e


class UserOrder:
    """The batches of indices of the user's ``sampler`` (batched by ``batch_size``, ``drop_last``) or ``batch_sampler``
    (its batches as they are, of any sizes), per epoch; the interface the loop and the sources use of a sampler."""

    def __init__(self, user: Any, batched: bool, num_samples: int, batch_size: int, seed: int, drop_last: bool,
                 world_size: int = 1, allow_size_change: bool = False) -> None:
        self.name = f"{type(user).__name__} (Loader({'batch_sampler' if batched else 'sampler'}=...))"
        _refuse(user, self.name, world_size, allow_size_change)
        self.user, self.batched = user, batched
        self.num_samples, self.batch_size, self.seed, self.drop_last = num_samples, batch_size, seed, drop_last
        self.rank, self.world_size, self.offset, self.allow_size_change = 0, 1, None, False
        self.length = len(user)
        self.batches_per_epoch = self.length if batched else (
            self.length // batch_size if drop_last else -(-self.length // batch_size))
        if self.batches_per_epoch < 1:
            raise ValueError(f"your {self.name} makes an empty epoch (len {self.length}, batch_size {batch_size}, "
                             f"drop_last={drop_last}): an epoch needs at least one batch; give it more samples")
        self.kind, self.on_iterator = kind_of(user, batched, seed)
        self.source_name = f"your {self.name}, {self.kind}"
        self._orders: dict[int, list[torch.Tensor]] = {}  # epoch -> its batches of indices
        self._starts: dict[int, Any] = {}  # kind 1: epoch -> the sampler's (or its iterator's) state at its start
        self._next = 0  # kinds 1 and 3 without a state to load: the epoch the sampler makes next, in sequence
        self._walked = 0  # the epoch the loop trains (or last trained): what a checkpoint needs the start of
        self._told = False

    def describe(self) -> str:
        """One line: how this run resumes the user's sampler."""
        owner = "its iterator's" if self.on_iterator else "its"
        how = {STATEFUL: f"{owner} state_dict at the start of each epoch is checkpointed and loaded on resume (O(1))",
               SEEDED: f"{self._seeding()} from (seed, epoch) before each epoch, so a resume makes that epoch again "
                       f"(O(1))",
               REPLAYED: "without set_epoch, a generator or state_dict it is replayed on resume from the run's start "
                         "(indices only, no data)"}[self.kind]
        return f"data order: your {self.name}, {self.batches_per_epoch} batches an epoch: {how}"

    def _seeding(self) -> str:
        parts = [("set_epoch is called", _set_epoch_of(self.user, self.batched)),
                 ("its generator is seeded", _generator_of(self.user, self.batched))]
        return " and ".join(text for text, there in parts if there is not None)

    # -- the interface of ResumableSampler --------------------------------------------------------------------
    def start_of(self, epoch: int) -> int:
        return 0

    def batches_in(self, epoch: int) -> int:
        return self.batches_per_epoch

    def epoch_done(self, epoch: int, batch_in_epoch: int) -> bool:
        return batch_in_epoch >= self.batches_per_epoch

    def batch(self, order: list[torch.Tensor], index: int, epoch: int | None = None) -> torch.Tensor:
        if not 0 <= index < len(order):
            raise IndexError(f"batch {index} is outside 0..{len(order) - 1}")
        return order[index]

    def walk(self, epoch: int, first: int, device: torch.device | None = None
             ) -> Iterator[tuple[int, torch.Tensor, int, bool]]:
        """``(index, indices, size, last)`` for batches ``first..`` of ``epoch`` (indices on ``device``)."""
        self._walked = epoch
        started = time.perf_counter()
        replay = self.kind == REPLAYED and epoch not in self._orders and (epoch, first) != (self._next, 0)
        order = self.epoch_order(epoch)
        if replay and not self._told:
            self._told = True
            log.info(f"replaying {epoch * self.batches_per_epoch + first} batches of indices of your {self.name} "
                     f"({(time.perf_counter() - started) * 1000:.0f} ms) to reach epoch {epoch} batch {first}; "
                     f"give it set_epoch/a generator/state_dict to resume in O(1)")
        for index in range(first, len(order)):
            indices = order[index].to(device) if device is not None else order[index]
            yield index, indices, len(indices), index + 1 == len(order)

    def upcoming(self, epoch: int, index: int) -> tuple[str, torch.Tensor] | None:
        """Batch ``index`` of ``epoch``'s indices, for a checkpoint's record (content_check.py)."""
        if not 0 <= index < self.batches_per_epoch:
            return None
        return "sample indices", self.epoch_order(epoch)[index]

    def epoch_order(self, epoch: int) -> list[torch.Tensor]:
        """The batches of indices of ``epoch`` (made once, kept for the few latest epochs)."""
        if epoch not in self._orders:
            if self.kind == SEEDED or epoch in self._starts:
                self._orders[epoch] = self._make(epoch)
            else:
                self._orders[epoch] = self._in_sequence(epoch)
            for old in sorted(self._orders)[:-_KEPT]:
                del self._orders[old]
        return self._orders[epoch]

    # -- making an epoch -----------------------------------------------------------------------------------------
    def _in_sequence(self, epoch: int) -> list[torch.Tensor]:
        if epoch < self._next:
            raise ValueError(f"your {self.name} was already iterated past epoch {epoch + 1} in this process and "
                             f"cannot go back ({self.kind}): build the sampler and the Run again, or give the sampler "
                             f"state_dict/load_state_dict, set_epoch or a generator")
        while self._next < epoch:  # the epochs before it, made again and dropped: a replay
            self._make(self._next)
        return self._make(epoch)

    def _make(self, epoch: int) -> list[torch.Tensor]:
        with _Seeded(epoch_seed(self.seed ^ _FORK, epoch)):
            if self.kind == SEEDED:
                self._seed(epoch)
            iterator = self._start(epoch) if self.kind == STATEFUL else iter(self.user)
            order = self._batches(iterator, epoch)
        if self.kind == STATEFUL:
            with _Seeded(epoch_seed(self.seed ^ _FORK, epoch + 1)):
                state = iter(self.user).state_dict() if self.on_iterator else self.user.state_dict()
            self._starts[epoch + 1] = copy.deepcopy(state)
            for old in [e for e in self._starts if e < min(self._walked, epoch)]:
                del self._starts[old]
        self._next = max(self._next, epoch + 1)
        return order

    def _seed(self, epoch: int) -> None:
        set_epoch, generator = _set_epoch_of(self.user, self.batched), _generator_of(self.user, self.batched)
        if set_epoch is not None:
            set_epoch(epoch)
        if generator is not None:
            generator.manual_seed(epoch_seed(self.seed, epoch))

    def _start(self, epoch: int) -> Iterator[Any]:
        """The iterator of ``epoch`` from its start state (loaded, or recorded now that the epoch begins)."""
        if not self.on_iterator:
            if epoch in self._starts:
                self.user.load_state_dict(copy.deepcopy(self._starts[epoch]))
            else:
                self._starts[epoch] = copy.deepcopy(self.user.state_dict())
            return iter(self.user)
        iterator = iter(self.user)
        if epoch in self._starts:
            iterator.load_state_dict(copy.deepcopy(self._starts[epoch]))
        else:
            self._starts[epoch] = copy.deepcopy(iterator.state_dict())
        return iterator

    def _batches(self, iterator: Iterator[Any], epoch: int) -> list[torch.Tensor]:
        what = f"your {self.name}"
        if self.batched:
            order = [_as_indices(b, what) for b in iterator]
            count, unit = len(order), "batches"
        else:
            flat = _as_indices(list(iterator), what)
            count, unit = len(flat), "indices"
            order = list(torch.split(flat, self.batch_size))
            if self.drop_last and order and len(order[-1]) < self.batch_size:
                order.pop()
        if count != self.length:
            raise ValueError(f"{what} gave {count} {unit} in epoch {epoch + 1}, but its len() is {self.length}: an "
                             f"epoch's length must be known before it starts; make __len__ exact")
        flat = torch.cat(order) if order else torch.empty(0, dtype=torch.int64)
        if any(len(b) == 0 for b in order):
            raise ValueError(f"{what} gave an empty batch in epoch {epoch + 1}; every batch needs an index")
        low, high = (int(flat.min()), int(flat.max())) if len(flat) else (0, 0)
        if low < 0 or high >= self.num_samples:
            raise ValueError(f"{what} gave index {low if low < 0 else high} in epoch {epoch + 1}, outside the "
                             f"dataset's 0..{self.num_samples - 1}")
        return order

    # -- checkpoint ------------------------------------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {"user_sampler": self.kind, "type": type(self.user).__qualname__, "batched": self.batched,
                "length": self.length, "batches": self.batches_per_epoch, "num_samples": self.num_samples,
                "batch_size": self.batch_size, "drop_last": self.drop_last, "seed": self.seed}

    def state_dict(self) -> dict[str, Any]:
        """The sampler's identity (a resume with another one is refused) and, for kind 1, its state at the start of
        the epoch trained and of the next (a checkpoint at an epoch's end resumes at the next one)."""
        state = self._identity()
        if self.kind == STATEFUL:
            walked = self._walked
            state["starts"] = [[e, self._starts[e]] for e in sorted(self._starts) if walked <= e <= walked + 1]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "user_sampler" not in state:
            raise ValueError(f"the checkpoint was written with resumable's own sampler, this run orders the data with "
                             f"your {self.name}: leave the sampler out to resume it, or start over with "
                             f"Session(resume='never', overwrite=True)")
        diffs = [f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in self._identity().items()
                 if state.get(k) != v]
        if diffs:
            raise ValueError("the data order of this run differs from the checkpoint's (" + "; ".join(diffs) + "); "
                             "pass the same sampler, data and options, or start over with "
                             "Session(resume='never', overwrite=True)")
        if self.kind == STATEFUL:
            starts = state.get("starts")
            if not (isinstance(starts, list) and all(isinstance(s, list) and len(s) == 2 and isinstance(s[0], int)
                                                     for s in starts)):
                raise ValueError(f"the checkpoint's state of your {self.name} is not a list of [epoch, state] pairs")
            self._starts = {e: s for e, s in starts}
            self._orders.clear()  # made again from the loaded states
            self._walked = min(self._starts, default=0)


def _refuse(user: Any, name: str, world_size: int, allow_size_change: bool) -> None:
    if not hasattr(user, "__iter__"):
        raise TypeError(f"your {name} is not iterable: a sampler yields dataset indices, a batch sampler lists of them")
    if not callable(getattr(user, "__len__", None)):
        raise ValueError(f"your {name} has no __len__: an epoch needs an end known before it starts; give it a "
                         f"__len__ (or use an IterableDataset as data, which ends an epoch when it is exhausted)")
    if world_size > 1:
        raise ValueError(f"your {name} under torchrun ({world_size} processes) is not supported: each rank would need "
                         f"its own exact share of its order; leave the sampler out (resumable's own sampler shards "
                         f"the data over ranks), or train in one process")
    if allow_size_change:
        raise ValueError(f"Session(allow_data_change=True) with your {name} is not supported: the sampler's order "
                         f"belongs to the data it was built for; start a new run dir for the new data")
