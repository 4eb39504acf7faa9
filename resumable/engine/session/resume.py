"""A session's start from the checkpoint its run dir chose: loaded on every rank (they fail together), the data
position remapped when the dataset or the number of processes changed, and what was loaded said in two lines; or,
without a checkpoint, the same fresh start every time in this process (fresh_start.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ... import log
from ...checkpoint import describe_age
from ...distributed import Distributed
from ...errors import ResumableError
from ..rundir.run_dir import Choice
from ..state.keeper import StateKeeper
from ..state.remap import accept_data_change, remap_position
from ..state.verify import check_schedulers
from . import fresh_start, notebook


@dataclass(frozen=True)
class Resumed:
    """Where this session starts: the checkpoint's step (None: fresh) and, with Session(allow_data_change=True), the
    dataset's change of size it accepted, as (the checkpoint's, now)."""

    step: int | None = None
    data_change: tuple[int, int] | None = None


@dataclass(frozen=True)
class Expected:
    """What the chosen checkpoint must match (the Run's computation, and the one change of it accepted on purpose)."""

    computation: dict[str, Any]
    run_dir: str
    api: bool  # messages name Run's arguments, not the command line's options
    allow_data_change: bool = False
    amp_switch: dict[str, Any] | None = None


def resume(keeper: StateKeeper, choice: Choice, expected: Expected, sampler: Any, dist: Distributed) -> Resumed:
    """Load ``choice.latest`` into the keeper's objects on every rank, or raise on every rank when one failed."""
    check_schedulers(keeper.objects, resuming=choice.latest is not None)  # the same on every rank
    resumed, error = Resumed(), None
    if choice.latest is not None:
        try:
            resumed = _load(keeper, choice, expected, sampler, dist)
        except Exception as e:  # noqa: BLE001 - any failure (an OSError too) must reach every rank
            error = e
    failed = dist.all_errors(None if error is None else str(error) if isinstance(error, ResumableError)
                             else f"{type(error).__name__}: {error}")
    if failed:
        if error is not None:
            raise error
        rank, message = failed[0]
        raise ResumableError(f"rank {rank} could not load the checkpoint: {message}")
    return resumed


def _load(keeper: StateKeeper, choice: Choice, expected: Expected, sampler: Any, dist: Distributed) -> Resumed:
    switch, state = expected.amp_switch, keeper.state
    info = keeper.resume(choice.latest, choice.skipped, expected.computation, expected.run_dir, expected.api,
                         ignore=frozenset({"num_samples"}) if expected.allow_data_change else frozenset(),
                         accept={"amp": (switch["from"], switch["to"])} if switch else None)
    change = None
    if expected.allow_data_change:
        change = accept_data_change(info, expected.computation.get("num_samples"), state)
        if change:  # another order from here on, by request: not a resume that went wrong
            keeper.data_next = None
    if dist.main:
        keeper.check_room()
    saved_world = info.manifest.get("world_size", 1)
    if saved_world != dist.world_size:
        remap_position(state, sampler, saved_world, dist.world_size, expected.computation.get("seed", 0), dist.rank)
    cost = keeper.restore_cost
    memory = (f", host memory peak +{cost.added / 1e6:.0f} MB" if cost is not None and cost.added is not None
              else "")
    log.info(f"resuming from step {info.step} (epoch {state.epoch}, batch {state.batch_in_epoch}), saved "
             f"{describe_age(info.created)}; loaded in {cost.seconds if cost is not None else 0:.2f}s{memory}")
    ahead = keeper.data_next
    first = f"; the first batch is compared with the checkpoint's record of its {ahead['of']}" if ahead else ""
    log.info(f"resume verified {keeper.verified}{first}")
    return Resumed(info.step, change)


def start(run_dir: str, given: dict[str, tuple[Any, Any]], model: torch.nn.Module, resumed: Resumed) -> None:
    """After :func:`resume`: a fresh start is the same every time in this process (``given``: name -> (what the user
    passed, what is checkpointed); fresh_start.py), and a model left in eval mode trains in train mode."""
    if resumed.step is None:
        line = fresh_start.start_fresh(run_dir, given, model, keep_copy=notebook.interactive())
        if line is not None:
            log.info(line)
        if not model.training:
            log.info("the model was in eval mode; training it in train mode (model.train())")
            model.train()
    else:
        fresh_start.forget(run_dir)
