"""resumable's own training state as a ``torch.distributed.checkpoint`` ``Stateful``, for a loop that writes its own
DCP checkpoints (torchtitan-style) and wants resumable's exact data position in them.

>>> state, sampler = TrainState(), ResumableSampler(n, batch, seed, rank=rank, world_size=world)  # doctest: +SKIP
>>> dcp.save({"model": ..., "resumable": PortableState(state, sampler, seed)}, checkpoint_id=path)  # doctest: +SKIP

DCP calls :meth:`PortableState.state_dict` at a save and :meth:`PortableState.load_state_dict` at a load. What it
holds: the loop position and counters (``TrainState``: epoch, batch in the epoch, step...), the sampler's order (its
identity and, after a change of world size, where the epoch goes on) and, keyed by rank, each rank's RNG streams
and per-rank counters. At the same world size a resumed loop repeats the uninterrupted one exactly. At another, load
with ``DefaultLoadPlanner(allow_partial_load=True)`` (the new ranks have no key of their own): the position is
remapped as a count of samples and each rank's RNG reseeded from (seed, rank, step), as ``Run`` does
(engine/state/remap.py).
"""

from __future__ import annotations

import io
from typing import Any

import torch

from ...distributed import Distributed
from ..data.sampler import ResumableSampler
from .remap import remap_position
from .train_state import TrainState, capture_rng, restore_rng


class PortableState:
    """``state`` and ``sampler`` (and this rank's RNG streams) as one DCP ``Stateful`` (see the module docstring)."""

    def __init__(self, state: TrainState, sampler: ResumableSampler, seed: int = 0) -> None:
        self.state, self.sampler, self.seed = state, sampler, seed

    def state_dict(self) -> dict[str, Any]:
        place = Distributed.current()
        rank, world = place.rank, place.world_size
        mine = io.BytesIO()  # one opaque entry a rank: DCP keeps every rank's, under its own key
        torch.save({"rng": capture_rng(), "counters": self.state.rank_dict()}, mine)
        return {"position": self.state.state_dict(), "sampler": self.sampler.state_dict(), "world_size": world,
                f"rank{rank}": mine.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        place = Distributed.current()
        rank, world = place.rank, place.world_size
        saved_world = int(state_dict["world_size"])
        self.state.load_state_dict(state_dict["position"])
        self.sampler.load_state_dict(state_dict["sampler"])
        if saved_world == world:
            mine = torch.load(io.BytesIO(state_dict[f"rank{rank}"]), weights_only=True)
            self.state.load_rank_dict(mine["counters"])
            restore_rng(mine["rng"])  # last: nothing after it may draw a random number
        else:
            remap_position(self.state, self.sampler, saved_world, world, self.seed, rank)
