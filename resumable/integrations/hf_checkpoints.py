"""Hugging Face ``checkpoint-N`` folders under resumable's commit protocol; no transformers import here.

The Trainer writes ``OUTPUT_DIR/checkpoint-N/`` (model, optimizer, scheduler, RNG states, trainer_state.json)
with plain writes and no marker of completion, so a kill mid-save leaves a folder that looks like a checkpoint.
:func:`commit` adds resumable's ``manifest.json`` (size and sha256 of every file, sealed by its own checksum,
written last and atomically, after every file was fsynced): from then on the folder is a checkpoint.
:func:`latest_valid` picks the newest folder whose manifest reads and whose every file verifies, and skips the
others with the reason, as resumable-train does. :func:`prune` applies ``save_total_limit`` only after a commit,
by step number, deleting a folder's manifest first.

The manifest is checkpoint/manifest.py's (read and validated the same way); only the folder name differs from
resumable's own ``step-N``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import log
from ..checkpoint import format as fmt
from ..checkpoint import manifest as manifests
from ..checkpoint import paths
from ..checkpoint.retention import Candidate, steps_to_prune

PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
_NAME = re.compile(r"checkpoint-([0-9]{1,19})")
_CHUNK = 1 << 20

Say = Callable[[str], None]


def folder_name(step: int) -> str:
    return f"{PREFIX}-{step}"


def parse_folder(name: str) -> int | None:
    """The step of a ``checkpoint-N`` name (ASCII digits only), or None for anything else."""
    match = _NAME.fullmatch(name)
    return int(match.group(1)) if match else None


@dataclass
class Folder:
    """One ``checkpoint-N`` folder and whether it is a valid checkpoint (``reason`` says why not)."""

    step: int
    path: Path
    manifest: dict[str, Any] | None
    reason: str | None = None

    @property
    def valid(self) -> bool:
        return self.reason is None

    @property
    def committed(self) -> bool:
        return os.path.lexists(self.path / fmt.MANIFEST)


def folders(output_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every ``checkpoint-N`` directory (a real one, never a link) in ``output_dir``, oldest first by step number
    (never by name or mtime: ``checkpoint-9`` is older than ``checkpoint-10``)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = parse_folder(entry.name)
        if step is None:
            continue
        if paths.is_real_dir(entry):
            found.append((step, entry))
        else:
            paths.warn_once(f"hf-entry:{entry}", f"{entry} is {paths.kind_of(entry)}, not a checkpoint folder: "
                            f"ignored")
    return sorted(found)


def check(step: int, path: Path, deep: bool = True) -> Folder:
    """Whether ``path`` is a committed, intact checkpoint of ``step`` (``deep``: every sha256, else sizes)."""
    try:
        manifest = manifests.read(path).body
    except fmt.InvalidCheckpoint as e:
        return Folder(step, path, None, str(e))
    if manifest["step"] != step:
        return Folder(step, path, manifest, f"manifest says step {manifest['step']}, but its folder is {path.name}")
    try:
        fmt.verify_files(path, manifest, deep=deep)
    except fmt.InvalidCheckpoint as e:
        return Folder(step, path, manifest, str(e))
    return Folder(step, path, manifest)


def newest_valid(output_dir: str | os.PathLike[str], say: Say | None = None) -> Folder | None:
    """The newest fully verified ``checkpoint-N``; each newer folder skipped is said with its reason."""
    say = say or log.warning
    for step, path in reversed(folders(output_dir)):
        info = check(step, path, deep=True)
        if info.valid:
            return info
        say(f"skipping {path.name} ({path}): {info.reason}")
    return None


# -- commit --------------------------------------------------------------------------------------------
def _hash_and_sync(path: Path) -> dict[str, Any]:
    """Size and sha256 of a regular file, which is fsynced on the way: the Trainer's writes are not, and the
    manifest must never reach the disk before the bytes it vouches for."""
    digest = hashlib.sha256()
    size = 0
    with paths.open_regular(path) as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(handle.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def payload_files(path: Path) -> list[str]:
    """The files a commit of ``path`` lists: every entry but the manifest and temp files. A folder inside (the
    sharded state of DeepSpeed or FSDP) or anything that is not a regular file is refused, naming it."""
    names = []
    for entry in sorted(path.iterdir()):
        if entry.name == fmt.MANIFEST or fmt.TMP_MARK in entry.name:
            continue
        if not paths.is_regular(entry):
            raise ValueError(f"{entry} is {paths.kind_of(entry)}: ResumableCallback commits checkpoint folders of "
                             f"regular files only (DeepSpeed/FSDP sharded checkpoints with sub-folders are not "
                             f"supported yet); train without them, or remove the callback")
        problem = paths.name_problem(entry.name)
        if problem is not None:
            raise ValueError(f"{entry}: the name cannot be listed in a manifest ({problem})")
        names.append(entry.name)
    if not names:
        raise ValueError(f"{path} holds no files to commit (did the Trainer save there?)")
    return names


def invalidate(path: Path) -> None:
    """Before the Trainer writes ``checkpoint-N`` again (a resume from an older one): its old manifest goes first,
    so the folder does not count while its files are replaced."""
    if paths.is_real_dir(path) and paths.unlink_in_dir(path, fmt.MANIFEST):
        fmt.fsync_dir(path)


def commit(path: Path, step: int, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``path/manifest.json`` for the files the Trainer saved there; returns the manifest. From the moment
    it is renamed into place the folder is a checkpoint, and not a moment before."""
    files = {name: _hash_and_sync(path / name) for name in payload_files(path)}
    fmt.fsync_dir(path)
    manifest = manifests.seal({
        **(meta or {}),
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "step": step,
        "files": files,
        "created_unix": time.time(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    })
    fmt.write_json_atomic(path / fmt.MANIFEST, manifest)
    fmt.fsync_dir(path.parent)
    return manifest


# -- retention -----------------------------------------------------------------------------------------
def delete(path: Path) -> None:
    """One checkpoint folder, manifest first (a half-deleted folder is never valid); a link is removed itself."""
    if not paths.is_real_dir(path):
        paths.remove_entry(path)
        return
    if paths.is_regular(path / fmt.MANIFEST):
        paths.unlink_in_dir(path, fmt.MANIFEST)
    paths.remove_tree(path)


def prune(output_dir: str | os.PathLike[str], keep: int, protect: Iterable[int] = ()) -> list[int]:
    """After a commit: keep the ``keep`` newest committed checkpoints (sizes checked) and ``protect`` (the
    best one); delete the other folders older than the newest of them, committed or not (a folder without a
    manifest older than a committed one is a killed save's leftover). Folders newer than the newest valid one
    are left alone: the Trainer writes over them when it gets there. Returns the deleted steps."""
    found = folders(output_dir)
    valid = [info for info in (check(step, path, deep=False) for step, path in found) if info.valid]
    if not valid:
        return []
    protect = set(protect)
    kept = {c.step for c in valid} - set(steps_to_prune([Candidate(i.step) for i in valid], keep, False, protect))
    newest = valid[-1].step
    doomed = [(step, path) for step, path in found if step < newest and step not in kept and step not in protect]
    for _, path in doomed:
        delete(path)
    return [step for step, _ in doomed]
