"""The training-state fingerprint: equal training states have equal fingerprints, whatever the files.

Version 3 (format 4 checkpoints) combines one line per tensor of the model and optimizer state (its path, dtype,
shape and digest, sorted by path), each digest the tensor's tree digest (treehash.py: sha256 of the sha256 of
each 16 MiB piece of its stored bytes, see shardfile.stored_form). Those are the digests a save computes while
it writes the shards, and that verifying a shard file computes from the file, so neither a save nor a resume
hashes a byte twice; they do not depend on how the tensors are grouped into files, nor on which thread wrote
them. Version 2 (format 3 checkpoints) is the same with one plain sha256 over each tensor's bytes
(:func:`tensor_digest`, which frozen-tensor records still use); version 1 (format 1 and 2 ``state.pt``
checkpoints) is :func:`resumable.checkpoint.format.fingerprint`. Both are kept to verify those checkpoints.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from . import shardfile, treehash
from .tree import Path, path_text, tensors

VERSION = 3
TENSOR_VERSION = 2  # format 3 checkpoints: one sha256 over each tensor's bytes
COVERED = ("model", "optimizer")  # the payload entries the fingerprint covers


def _stored(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.layout != torch.strided:  # sparse and friends: never sharded, rare; their dense values count
        tensor = tensor.to_dense()
    return shardfile.stored_form(tensor)[0]


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in memory order (the bytes a shard stores): fingerprint version 2, and the
    frozen-base records of manifests (engine/state/frozen.py)."""
    digest = hashlib.sha256()
    for view in shardfile.chunks(_stored(tensor)):
        digest.update(view)
    return digest.hexdigest()


def tree_digests(tensors_: Iterable[torch.Tensor]) -> list[str]:
    """The tree digest (treehash.py) of each tensor's stored bytes (fingerprint version 3), every piece of every
    tensor queued on the pool before any is waited for."""
    hashes = []
    for tensor in tensors_:
        own = treehash.TensorHash()
        stored = _stored(tensor)
        for view in shardfile.chunks(stored):
            pieces = own.add(view)
            if not stored.is_cpu:
                treehash.wait(pieces)  # before the next chunk reuses the bounce buffer
        hashes.append(own)
    return [own.digest().hex() for own in hashes]


def tree_digest(tensor: torch.Tensor) -> str:
    return tree_digests([tensor])[0]


def line(path: Path, tensor: torch.Tensor, digest: str) -> tuple[str, str]:
    """One tensor's contribution: (its path text, the line hashed for it)."""
    text = path_text(path)
    return text, f"{text}|{tensor.dtype}|{tuple(tensor.shape)}|{digest}\n"


def combine(lines: Iterable[tuple[str, str]]) -> str:
    digest = treehash.sha256()
    for _, text in sorted(lines):
        digest.update(text.encode())
    return digest.hexdigest()


def covered(path: Path) -> bool:
    return bool(path) and path[0] in COVERED


def of_payload(payload: dict[str, Any], version: int = VERSION, known: dict[Path, str] | None = None) -> str:
    """The fingerprint (``version`` 3 or 2) of a payload's model and optimizer state. ``known``: version 3 tensor
    digests already computed (path -> hex, from verifying the shard files); the other tensors are hashed here."""
    if version not in (VERSION, TENSOR_VERSION):
        raise ValueError(f"fingerprint version {version} is not one of {VERSION} and {TENSOR_VERSION}")
    found = list(tensors({name: payload.get(name) for name in COVERED}))
    if version == TENSOR_VERSION:
        return combine(line(path, tensor, tensor_digest(tensor)) for path, tensor in found)
    known = known or {}
    missing = [(path, tensor) for path, tensor in found if path not in known]
    computed = dict(zip((path for path, _ in missing), tree_digests(t for _, t in missing), strict=True))
    return combine(line(path, tensor, known[path] if path in known else computed[path]) for path, tensor in found)
