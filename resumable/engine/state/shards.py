"""The model and optimizer of a sharded (FSDP2) run, in each save and resume: every rank writes and reads its own
shards through torch.distributed.checkpoint (checkpoint/dcp.py), in the background over a gloo group of their own
when saves are asynchronous; rank 0 lists the files in the manifest it commits, once every rank's are on disk."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...checkpoint import CheckpointManager, dcp
from ...checkpoint.adopt import describe
from ...checkpoint.tree import tensors
from ...distributed import Distributed
from ...errors import ResumeNotApplied, SaveFailed
from .verify import difference

IN_DCP = ("model", "optimizer")  # the payload entries whose state is in DCP's files
MARK = {"sharded": dcp.KIND}  # what the payload rank 0 writes holds in their place


class Shards:
    """This rank's shards of ``model`` and ``optimizer`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dist: Distributed,
                 asynchronous: bool) -> None:
        self.model, self.optimizer, self.dist = model, optimizer, dist
        self._group = dcp.checkpoint_group() if asynchronous and dist.active else None
        self.pending: Any = None  # the future of this rank's last background save

    def save(self, manager: CheckpointManager, step: int, discard: Callable[[int], None]) -> None:
        """Every rank: this rank's shards into the step's folder (DCP, a collective), once rank 0 has made the folder.
        A failure on any rank fails the save on every rank; nothing is committed (``discard``: rank 0's clean-up)."""
        self.wait()
        directory = manager.folder(step)
        problem = None
        if self.dist.main:
            try:
                if not manager.root.parent.is_dir():
                    raise OSError(f"the run dir {manager.root.parent} is gone")
                manager.begin(step)
            except OSError as e:
                problem = f"cannot create its folder in {manager.root} ({e})"
        failed = self.dist.all_errors(problem)
        if failed:
            rank, message = failed[0]
            raise SaveFailed(f"saving the checkpoint of step {step} failed on rank {rank}: {message}")
        try:
            if self._group is not None:  # returns once this rank's shards are copied
                self.pending = dcp.save_async(directory, self.model, self.optimizer, self._group)
            else:
                dcp.save(directory, self.model, self.optimizer)
        except Exception as e:  # noqa: BLE001 - DCP raises on every rank when one failed
            if self.dist.main:
                discard(step)
            raise SaveFailed(f"saving the sharded state of step {step} failed: {e}") from e

    def wait(self) -> None:
        """This rank's shards of the last background save are on disk; SaveFailed if writing them failed."""
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                pending.result()
            except Exception as e:  # noqa: BLE001 - any failure of the background write
                raise SaveFailed(f"writing this rank's shards of the last checkpoint failed: {e}") from e

    @staticmethod
    def files(directory: Path, pending: Any) -> dict[str, dict[str, Any]]:
        """Rank 0, on the writer's thread: every rank's files of the save ``pending`` belongs to, for the manifest
        (DCP writes its metadata once every rank's shards are on disk)."""
        if pending is not None:
            pending.result()
        return {name: describe(directory / name) for name in dcp.names(directory)}

    def load(self, directory: Path) -> str:
        """Read this rank's shards (resharded from any world size) and compare the live ones with what was read;
        returns what was checked. ResumeNotApplied names the first difference."""
        loaded = dcp.load(directory, self.model, self.optimizer)
        live = dcp.local_state(self.model, self.optimizer)
        where = difference(loaded, live)
        if where is not None:
            raise ResumeNotApplied(f"resume verification failed: this rank's shard of {where} does not hold the "
                                   f"checkpoint's state after loading it; nothing was changed on disk")
        local = [tensor for _, tensor in tensors(live)]
        return (f"model + optimizer shards of rank {self.dist.rank} byte-equal to the checkpoint ({len(local)} "
                f"tensors, {sum(t.numel() * t.element_size() for t in local) / 1e6:.1f} MB)")

    def release(self) -> None:
        """The session's saves are over (every rank waited for its shards): the group of the background saves goes
        now. Left to interpreter teardown, gloo can abort a process that ended cleanly (SIGABRT)."""
        group, self._group = self._group, None
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(group)
            del group
            gc.collect()  # DCP's finished background save may still hold the group in a reference cycle
