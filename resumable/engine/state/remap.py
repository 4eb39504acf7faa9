"""Where a resumed run starts in its data when the data or the number of processes changed since the
checkpoint: both keep training going, neither is bit-identical to a run that kept them, and both say so."""

from __future__ import annotations

from typing import Any

from ... import log
from ...errors import ResumableError
from ..data.sampler import ResumableSampler
from .train_state import TrainState


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


def remap_position(state: TrainState, sampler: ResumableSampler, saved_world: int, accumulate: int,
                   world: int) -> None:
    """Resume with another number of processes: keep the position in the epoch by sample count."""
    samples = state.batch_in_epoch * sampler.batch_size * saved_world
    batch = min(samples // sampler.global_batch, sampler.batches_per_epoch)
    batch -= batch % accumulate
    log.warning(f"the checkpoint was written by {saved_world} process(es), this run has {world}: the position in "
                f"epoch {state.epoch + 1} is remapped by sample count (batch {state.batch_in_epoch} → {batch}). "
                f"Training continues, but is not bit-identical to a run that kept one world size")
    state.batch_in_epoch = batch
