"""Committing a folder another program wrote: the files the Trainer saved in ``checkpoint-N`` become a checkpoint.

The Trainer writes its files with plain writes and no marker of completion, so a kill mid-save leaves a folder that
looks like a checkpoint. :func:`listed_files` hashes (sha256) and fsyncs each file, as the manifest needs it and
before the manifest can reach the disk; CheckpointManager.adopt then writes the manifest last, as for a save of its
own. Only regular files directly in the folder are listed: a folder inside (the sharded state of DeepSpeed or FSDP),
a link or a FIFO is refused, naming it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from . import format as fmt
from . import paths

_CHUNK = 1 << 20


def listed_files(folder: Path) -> dict[str, dict[str, Any]]:
    """The manifest's ``files`` for what is in ``folder`` now: size and sha256 of each file, fsynced on the way."""
    return {name: describe(folder / name) for name in _payload(folder)}


def describe(path: Path) -> dict[str, Any]:
    """A regular file's manifest entry (size and sha256), fsynced on the way: another program wrote it, maybe without
    an fsync, and the manifest must never reach the disk before the bytes it vouches for."""
    digest = hashlib.sha256()
    size = 0
    with paths.open_regular(path) as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(handle.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def _payload(folder: Path) -> list[str]:
    names = []
    for entry in sorted(folder.iterdir()):
        if entry.name == fmt.MANIFEST or fmt.TMP_MARK in entry.name:
            continue
        if not paths.is_regular(entry):
            raise ValueError(f"{entry} is {paths.kind_of(entry)}: only checkpoint folders of regular files can be "
                             f"committed (DeepSpeed/FSDP sharded checkpoints with sub-folders are not supported "
                             f"yet); train without them, or remove the callback")
        problem = paths.name_problem(entry.name)
        if problem is not None:
            raise ValueError(f"{entry}: the name cannot be listed in a manifest ({problem})")
        names.append(entry.name)
    if not names:
        raise ValueError(f"{folder} holds no files to commit (did the Trainer save there?)")
    return names
