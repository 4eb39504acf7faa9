"""Distributed data parallel under ``torchrun``: which process this is, and the few collectives the engine
needs to keep every rank in lock step.

``torchrun`` sets ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``; with more than one process the default group
is initialised (NCCL on GPUs, gloo on CPU). All ranks take the same decisions at the same step boundary: one
small ``all_reduce(MAX)`` per step carries "a signal arrived", "the budget is spent", "a save failed" and "the
wall-clock checkpoint trigger fired" from any rank to all. Rank 0 writes checkpoints, metrics and the run-dir
lock; every rank's RNG state is gathered into the checkpoint and restored on the matching rank.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch


def _attempt_store(world: int) -> Any:
    """The rendezvous store, with keys private to this restart of the worker group.

    After ``torchrun --max-restarts`` restarts the group, the default ``env://`` initialisation reads the
    workers' addresses that the previous attempt left in torchrun's store, and gloo then dials the dead
    processes ("Connection refused") until it gives up. Prefixing the keys with the restart count makes
    every attempt rendezvous afresh."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's own store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not hosted_by_agent and rank == 0, timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"resumable/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(device_type: str = "cuda") -> Distributed:
    """Join the ``torchrun`` job (NCCL for ``cuda``, gloo for ``cpu``) in a way that survives elastic
    restarts; call it before wrapping the model in ``DistributedDataParallel``. A single process: no-op."""
    return Distributed.from_env(device_type)


class Pending:
    """A collective started with ``async_op=True`` and its result tensor."""

    def __init__(self, work: Any, values: torch.Tensor) -> None:
        self.work = work
        self.values = values

    def result(self) -> list[bool]:
        self.work.wait()
        return [bool(v) for v in self.values.tolist()]


class Distributed:
    """This process's place in a job: rank 0 of 1 unless started by ``torchrun`` with several processes."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank

    @classmethod
    def from_env(cls, device_type: str) -> Distributed:
        """Join the torchrun job this process belongs to, if any (initialising the default group once)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=_attempt_store(world),
                                    rank=int(os.environ["RANK"]), world_size=world)
        return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))

    @classmethod
    def current(cls) -> Distributed:
        """The job of an already initialised default group (e.g. set up by the user's script), if any."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
        return cls()

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def any(self, flags: list[bool], device: torch.device) -> list[bool]:
        """Element-wise OR of ``flags`` over all ranks (one all_reduce)."""
        if not self.active:
            return flags
        import torch.distributed as dist

        values = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return [bool(v) for v in values.tolist()]

    def any_async(self, flags: list[bool], device: torch.device) -> Pending:
        """Start :meth:`any` without waiting; ``.result()`` waits (call it at the next decision point)."""
        import torch.distributed as dist

        values = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float32, device=device)
        return Pending(dist.all_reduce(values, op=dist.ReduceOp.MAX, async_op=True), values)

    def all_errors(self, error: str | None) -> list[tuple[int, str]]:
        """Every rank's error (rank, message), so all ranks fail together instead of one waiting forever."""
        if not self.active:
            return [(0, error)] if error else []
        import torch.distributed as dist

        out: list[str | None] = [None] * self.world_size
        dist.all_gather_object(out, error)
        return [(rank, message) for rank, message in enumerate(out) if message]

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """Element-wise sum of ``values`` over all ranks (float64, one all_reduce)."""
        if not self.active:
            return values
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.active:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
