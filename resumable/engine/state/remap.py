"""Where a resumed run starts in its data when the data or the number of processes changed since the
checkpoint: both keep training going, neither is bit-identical to a run that kept them, and both say so."""

from __future__ import annotations

import hashlib
from typing import Any

from ... import log
from ...errors import ResumableError
from ..data.sampler import ResumableSampler
from .train_state import TrainState, seed_everything


def accept_data_change(info: Any, now: int | None, state: TrainState) -> tuple[int, int] | None:
    """With ``allow_data_change``: a dataset whose length changed since the checkpoint is taken at an epoch
    boundary (the next epoch's order is computed for the new length); mid-epoch the old epoch's order cannot
    go on, so it is refused. Returns (checkpoint's, now) when it changed, for the session history."""
    saved = (info.manifest.get("computation") or {}).get("num_samples")
    if saved is None or saved == now:
        return None
    if state.batch_in_epoch != 0:
        raise ResumableError(f"the dataset has {now} samples, the checkpoint of step {info.step} was taken in the "
                             f"middle of an epoch over {saved}: a changed dataset is accepted at an epoch boundary "
                             f"only. Resume with the old data until the epoch ends, or start a new run dir")
    log.warning(f"the dataset changed from {saved} to {now} samples since step {info.step}: epoch {state.epoch + 1} "
                f"on uses the new data (Session(allow_data_change=True)); the run is no longer comparable with an "
                f"uninterrupted one over the old data")
    return saved, now


def remap_position(state: TrainState, sampler: ResumableSampler, saved_world: int, world: int, seed: int,
                   rank: int) -> None:
    """Resume with another number of processes: the epoch goes on at the exact sample the checkpoint reached (no
    sample skipped or trained twice, whatever the new global batch), from a new batch 0 (a step boundary), and this
    rank's random streams are reseeded from (seed, rank, step): the saved ones belong to other ranks' work."""
    done = min(sampler.start_of(state.epoch) + state.batch_in_epoch * sampler.batch_size * saved_world,
               sampler.num_samples)  # at an epoch's end its short last batch counts what it had
    sampler.offset = (state.epoch, done) if done else None
    state.batch_in_epoch = 0
    seed_everything(rank_seed(seed, rank, state.step))
    log.warning(f"the checkpoint was written by {saved_world} process(es), this run has {world}: epoch "
                f"{state.epoch + 1} goes on at sample {done} of {sampler.num_samples} (none skipped or trained twice) "
                f"and each rank's random streams are reseeded from (seed, rank, step). Training continues, but is not "
                f"bit-identical to a run that kept one world size")


def rank_seed(seed: int, rank: int, step: int) -> int:
    """The seed of ``rank``'s random streams after a change of world size at ``step``."""
    return int.from_bytes(hashlib.sha256(f"resumable:{seed}:{rank}:{step}".encode()).digest()[:8], "big") >> 1
