"""The engine's entry for tools built on it (``resumable-train``): a :class:`Task` that builds its :class:`Run` once the
checkpoint it resumes is known, and :func:`train_task`, which joins the process group, opens the run dir, has the task
build the Run and trains it to the end of the session."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .. import log
from ..checkpoint.writer import SaveStats
from ..distributed import Distributed
from ..faults import installed as installed_faults
from ..policies import Location
from .run import Opening, Run, ToolHooks
from .rundir.run_dir import Choice, RunDir
from .state.train_state import TrainState


@dataclass
class TaskResult:
    # 0 done, 75 stopped early with state committed (run again to continue); 0 as well for a stop on purpose
    # under torchrun, recorded in RUN_DIR/stopped.json (`resumable torchrun` turns it into 75); 74 not on Drive
    exit_code: int
    state: TrainState
    stats: SaveStats | None


class Task(Protocol):
    """A training task that is built once the checkpoint it resumes is known (``resumable-train``: the options not
    given again come from the checkpoint's config, ``--amp auto`` keeps its mode). The engine calls it; it never
    imports it."""

    def device_type(self) -> str:
        """"cuda" or "cpu": the device, and the process group's backend under torchrun."""
        ...

    def location(self) -> Location:
        """The run dir, its cache and Drive credentials."""
        ...

    def identity(self) -> tuple[str, str]:
        """Digests of the task's code and of the options it was given (the crash-loop check)."""
        ...

    def build(self, dist: Distributed, choice: Choice) -> tuple[Run, Callable[[Any], torch.Tensor]]:
        """The Run resuming ``choice.latest`` (None: a fresh start) and the train step of one batch (its loss)."""
        ...


def train_task(task: Task, opening: Opening) -> TaskResult:
    """Join the process group (torchrun), open and lock the run dir and choose the checkpoint, have ``task`` build its
    Run for it and train it to the end of this session; the run dir is released and the group left whatever
    happens."""
    dist = Distributed.from_env(task.device_type())
    log.set_rank(dist.rank)  # before the task is built: only rank 0 speaks from the start
    try:
        return _train(*_open_and_build(task, opening, dist))
    finally:
        # The DDP model (and the Run around it) hold the process group. Free them now, while the interpreter is
        # whole, so that destroying the group really ends gloo's threads here and not during interpreter
        # teardown, where a late gloo destructor can abort the process (SIGABRT) after a clean run. Only then: a
        # full collection took 0.1 s of every single-process exit.
        if dist.active:
            gc.collect()
        dist.close()


def _open_and_build(task: Task, opening: Opening, dist: Distributed) -> tuple[Run, Callable[[Any], torch.Tensor]]:
    where = task.location()
    rundir, choice = RunDir.open(dist, str(where.path), where.cache_dir, where.credentials, opening.mode,
                                 opening.overwrite, opening.resume_from,
                                 opening.ignore_crash_loop or installed_faults().ignore_crash_loop, task.identity())
    try:
        run, step = task.build(dist, choice)
    except BaseException:
        rundir.release()  # the Run never started: give the lock back here
        raise
    return run._for_tool(ToolHooks(prepared=(rundir, choice, opening))), step


def _train(run: Run, step: Callable[[Any], torch.Tensor]) -> TaskResult:
    try:
        for _epoch, _step, batch in run:
            run.log(step(batch))
    except BaseException as e:
        run.close(e)  # an exception (a second Ctrl-C) ends the session here, recorded, not at interpreter teardown
        raise
    run.close()
    return TaskResult(run.exit_code, run.state, run.stats)
