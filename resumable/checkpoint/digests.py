"""The training-state fingerprint: equal training states have equal fingerprints, whatever the files.

Version 2 (sharded checkpoints) combines one sha256 per tensor of the model and optimizer state, taken over the
tensor's bytes in memory order (see shardfile.stored_form), with its path, dtype and shape. Per-tensor digests
let a save hash each tensor where it happens to be written (some on the training thread, some in the
background) and still give one value. Version 1 (format 1 and 2 ``state.pt`` checkpoints) is
:func:`resumable.checkpoint.format.fingerprint`, kept to verify those.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from . import shardfile
from .tree import Path, path_text, tensors

VERSION = 2
COVERED = ("model", "optimizer")  # the payload entries the fingerprint covers


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in memory order (the bytes a shard stores)."""
    tensor = tensor.detach()
    if tensor.layout != torch.strided:  # sparse and friends: never sharded, rare; their dense values count
        tensor = tensor.to_dense()
    stored, _ = shardfile.stored_form(tensor)
    digest = hashlib.sha256()
    for view in shardfile.chunks(stored):
        digest.update(view)
    return digest.hexdigest()


def line(path: Path, tensor: torch.Tensor, digest: str) -> tuple[str, str]:
    """One tensor's contribution: (its path text, the line hashed for it)."""
    text = path_text(path)
    return text, f"{text}|{tensor.dtype}|{tuple(tensor.shape)}|{digest}\n"


def combine(lines: Iterable[tuple[str, str]]) -> str:
    digest = hashlib.sha256()
    for _, text in sorted(lines):
        digest.update(text.encode())
    return digest.hexdigest()


def covered(path: Path) -> bool:
    return bool(path) and path[0] in COVERED


def of_payload(payload: dict[str, Any]) -> str:
    """The version 2 fingerprint of a payload's model and optimizer state (computed from its tensors)."""
    subset = {name: payload.get(name) for name in COVERED}
    return combine(line(path, tensor, tensor_digest(tensor)) for path, tensor in tensors(subset))
