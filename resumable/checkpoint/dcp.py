"""Sharded model and optimizer state (FSDP2: the parameters are DTensors) through torch.distributed.checkpoint.

Every rank writes its own shards into the step's folder (``__<rank>_0.distcp``), and DCP's ``.metadata`` is written
by rank 0 once every rank has finished; resumable's manifest, written after that by rank 0, lists these files with
their sizes and sha256 like any other and stays the commit marker. DCP reshards on load: a checkpoint written by N
ranks loads into M. A checkpoint whose rank files are not those of the world size it records is refused, never
loaded in part.
"""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from .format import InvalidCheckpoint
from .tree import map_leaves

METADATA = ".metadata"
KIND = "dcp"  # manifest["sharded"]: model and optimizer are in DCP's files
_RANK_FILE = re.compile(r"__([0-9]+)_([0-9]+)\.distcp")


def is_sharded(model: Any) -> bool:
    """Whether ``model``'s parameters are sharded (DTensors: ``fully_shard``), so that no rank holds the whole."""
    if not isinstance(model, torch.nn.Module):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def save(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write this rank's shards into ``directory`` (a collective: every rank calls it; fsynced before it returns)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizer), storage_writer=dcp.FileSystemWriter(directory, sync_files=True))


def save_async(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: Any) -> Future:
    """:func:`save` in the background: returns once this rank's shards are copied (training may change them then);
    the future is done when they are written and fsynced, and on rank 0 once DCP's metadata is written too, which
    DCP does after every rank has written its shards. ``group``: the process group of these saves
    (:func:`checkpoint_group`), never the one training's collectives use."""
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(_state(model, optimizer), storage_writer=dcp.FileSystemWriter(directory, sync_files=True),
                          process_group=group)


def checkpoint_group() -> Any:
    """A gloo group of every rank for the background saves' collectives (a collective call: every rank makes it)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def names(directory: Path) -> list[str]:
    """DCP's files in ``directory``: the metadata and every rank's shards."""
    return sorted(entry.name for entry in directory.iterdir()
                  if entry.name == METADATA or _RANK_FILE.fullmatch(entry.name))


def fingerprint(payload_fingerprint: str, files: dict[str, Any]) -> str:
    """A sharded checkpoint's training-state fingerprint: the rest of the payload's, and the sha256 of every rank's
    shard file (the same bytes for the same state at the same world size; DCP's metadata is not: it is left out)."""
    shards = sorted((name, entry["sha256"]) for name, entry in files.items() if _RANK_FILE.fullmatch(name))
    text = payload_fingerprint + "".join(f"|{name}:{sha}" for name, sha in shards)
    return hashlib.sha256(text.encode()).hexdigest()


def check_ranks(manifest: dict[str, Any]) -> None:
    """The manifest's DCP files must be the metadata and one file of each rank of the world size it records."""
    world = manifest.get("world_size", 1)
    listed = manifest.get("files") or {}
    ranks = {int(match.group(1)) for name in listed if (match := _RANK_FILE.fullmatch(name))}
    expected = set(range(world)) if isinstance(world, int) and world > 0 else set()
    if METADATA not in listed or ranks != expected:
        missing, extra = sorted(expected - ranks), sorted(ranks - expected)
        raise InvalidCheckpoint(f"its sharded state does not match the {world} rank(s) it was written by (rank "
                                f"files missing: {missing}, unexpected: {extra}"
                                f"{'' if METADATA in listed else ', no .metadata'}); it is not loaded in part")


def load(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Read the shards this rank needs (resharded from any world size) into ``model`` and ``optimizer``; returns this
    rank's part of the state as read (copies of its local shards), to compare with :func:`local_state`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optimizer)
    dcp.load(state, storage_reader=dcp.FileSystemReader(directory))
    read = map_leaves(state, lambda _path, leaf: _local(leaf).clone() if isinstance(leaf, torch.Tensor) else leaf)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return read


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's live part of the model and optimizer state: every DTensor as its local shard."""
    return map_leaves(_state(model, optimizer),
                      lambda _path, leaf: _local(leaf) if isinstance(leaf, torch.Tensor) else leaf)


def read_model(directory: Path) -> dict[str, torch.Tensor]:
    """The whole model state of a DCP checkpoint, gathered in this process without a process group (what
    ``dcp_to_torch_save`` does; every tensor is read, the optimizer's too, so it needs memory for the whole state)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(directory), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    model = state.get("model")
    if not isinstance(model, dict):
        raise InvalidCheckpoint(f"{directory}: its sharded state holds no model")
    return {key: value.detach().cpu() for key, value in model.items() if isinstance(value, torch.Tensor)}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().cpu().contiguous()
