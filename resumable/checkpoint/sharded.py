"""Formats 3 and 4: the state's tensors in safetensors shards, everything else in a small ``meta.pt``.

Layout of a step dir::

    shard-00000.safetensors ...  tensors, in the state's order, at most ``shard_size`` bytes per file (a larger
                                 tensor gets a file of its own)
    meta.pt                      torch.save of the state with each sharded tensor replaced by None, and the index
                                 (structural path -> shard, name, shape and strides); weights_only loadable
    manifest.json                written last by the manager: every file with its size and digest (format 4: a
                                 shard's is its tree digest, treehash.py, marked ``"digest": "sha256-tree"``)

Writing happens in two parts (pytorch#144657: nothing the training thread changes after ``save()`` returns may
reach the checkpoint). :meth:`ShardedFormat.begin`, on the training thread, copies shards into the staging
memory while it has room, and writes the rest straight from the live tensors; :meth:`Pending.finish`, on the
writer's thread, writes the staged shards and ``meta.pt``. A shard whose bytes equal the same shard of the
previous committed checkpoint (same name, size and tree digest) is hard-linked to it instead of written again.

Each shard is hashed once, on the way to its file: its 16 MiB pieces are hashed on two threads while the writing
thread writes them, and the file's digest, each tensor's digest (the training-state fingerprint, digests.py) and
the comparison with the previous checkpoint all come from those piece digests. A shard's fsync and rename run on
another thread while the next shard is written; :meth:`Pending.finish` returns once every one is done. A shard
that was unchanged last time is hashed before it is written instead, and linked or written without hashing.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..faults import NO_FAULTS, Faults
from . import digests as fpr
from . import format as fmt
from . import paths, shardfile, treehash
from .shardfile import Item
from .staging import Staging, aligned
from .state_format import Deadline, Previous, Written, check_structure, load_timeout_from_env
from .tree import map_leaves, path_text

KIND = "safetensors-shards"
META = "meta.pt"
DEFAULT_SHARD_SIZE = 256 << 20
# With a staging budget, shards are at most a quarter of it (and at least this), so that a budget smaller than the
# state still stages most of it: a shard is staged whole or written whole. The layout stays the same for a session.
MIN_SHARD = 1 << 20


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass
class _Shard:
    name: str
    items: list[Item]
    offset: int | None = None  # its region in the staging memory, when staged


@dataclass
class Pending:
    """A save between its training-thread part and its background part."""

    format: ShardedFormat
    directory: Path
    meta: dict[str, Any]
    queued: list[_Shard]
    previous: dict[str, Previous]
    staging: Staging | None
    result: Written
    lines: list[tuple[str, str]] = field(default_factory=list)
    paths_of: dict[str, Any] = field(default_factory=dict)  # item name -> structural path
    syncs: list[_Sync] = field(default_factory=list)  # the shards' fsync and rename (_write)

    def finish(self) -> Written:
        """Write the staged shards and ``meta.pt``; returns the files for the manifest once every file is durable."""
        try:
            meta = fmt.loadable_bytes(self.meta)  # first: a state that could never load is not written at all
            for shard in self.queued:
                self.format.emit(self, shard)
            self.result.files[META] = fmt.write_bytes_atomic(self.directory, meta, META)
            self.result.written += self.result.files[META]["size"]
            for synced in self.syncs:
                synced.result()  # raises the first fsync or rename that failed
        finally:
            self.settle()
            if self.staging is not None:
                self.staging.release_all()
        self.result.fingerprint = fpr.combine(self.lines)
        return self.result

    def settle(self) -> None:
        """Wait for every shard's fsync and rename (their errors are raised by :meth:`finish`)."""
        for synced in self.syncs:
            synced.join()


class ShardedFormat:
    """Format 4 (see the module docstring; format 3 is read). ``shard_size``: the most bytes of tensors per file."""

    name = KIND

    def __init__(self, shard_size: int = DEFAULT_SHARD_SIZE, load_timeout_s: float | None = None,
                 faults: Faults = NO_FAULTS, share_limit: int | None = None) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size={shard_size} must be at least 1 byte")
        if load_timeout_s is not None and not (load_timeout_s > 0 and math.isfinite(load_timeout_s)):
            raise ValueError(f"load_timeout_s={load_timeout_s!r} must be a number of seconds > 0")
        self.shard_size = shard_size
        # How many checkpoints may share one file (hard links): --keep - 1, so that with keep >= 2 one damaged file
        # never invalidates every kept checkpoint; None: no limit (keep 1, where there is no second one anyway).
        self.share_limit = share_limit
        self.load_timeout_s = load_timeout_from_env() if load_timeout_s is None else float(load_timeout_s)
        self.faults = faults
        # Shard name -> whether it equalled the previous checkpoint's last time: an unchanged one is hashed before
        # it is written (and linked if it is unchanged again), a changed one hashed while it is written (one pass).
        self._unchanged_before: dict[str, bool] = {}

    # -- writing -------------------------------------------------------------------------------------
    def write(self, directory: Path, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The whole save at once (the StateFormat protocol): every file written from ``state`` as it is."""
        return self.begin(directory, state).finish().files

    def begin(self, directory: Path, state: dict[str, Any], previous: dict[str, Previous] | None = None,
              staging: Staging | None = None) -> Pending:
        """The training thread's part: once it returns, every tensor of ``state`` is staged or on disk.

        ``staging`` None: nothing is staged, every shard is written here (a synchronous save)."""
        pending = Pending(self, Path(directory), {}, [], previous or {}, staging,
                          Written({}, "", fpr.VERSION))
        limit = self.shard_size if staging is None else min(self.shard_size, max(staging.capacity // 4, MIN_SHARD))
        shards, skeleton, index = self._plan(state, pending, limit)
        pending.meta = {"kind": KIND, "tree": skeleton, "tensors": index}
        total = sum(aligned(item.size) for shard in shards for item in shard.items)
        devices: set[torch.device] = set()
        try:
            if staging is not None:
                staging.prepare(total, pinned=any(item.tensor.is_cuda for s in shards for item in s.items))
            for shard in shards:
                need = sum(aligned(item.size) for item in shard.items)
                shard.offset = staging.reserve(need) if staging is not None and need else None
                if shard.offset is not None:
                    self._stage(staging, shard, devices)
                    pending.result.staged += need
                    pending.queued.append(shard)
                else:
                    pending.result.direct += sum(item.size for item in shard.items)
                    self.emit(pending, shard)
            for device in sorted(devices, key=str):  # the asynchronous copies are complete when save() returns
                torch.cuda.synchronize(device)
        except BaseException:
            pending.settle()  # nothing renames a file into the folder after a failed save has been reported
            if staging is not None:
                staging.release_all()
            raise
        return pending

    def _plan(self, state: dict[str, Any], pending: Pending, limit: int) -> tuple[list[_Shard], Any, list[list[Any]]]:
        """The shards (tensors in the state's order, at most ``limit`` bytes each unless one tensor is larger), the
        skeleton for meta.pt and its index."""
        items: list[Item] = []
        index: list[list[Any]] = []
        names: set[str] = set()

        def take(path: tuple[Any, ...], leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            covered = fpr.covered(path)
            if not shardfile.shardable(leaf):  # a dtype or layout safetensors has no code for: in meta.pt
                copy = leaf.detach().to("cpu", copy=True)
                if covered:
                    pending.lines.append(fpr.line(path, copy, fpr.tree_digest(copy)))
                return copy
            stored, stride = shardfile.stored_form(leaf)
            name = path_text(path) or "/"
            while name in names:  # {0: a} and {"0": b} have one path text
                name += "#"
            names.add(name)
            items.append(Item(name, stored, digest=covered))
            pending.paths_of[name] = (path, leaf)
            index.append([list(path), "", name, list(leaf.shape) if stride is not None else None, stride])
            return None

        skeleton = map_leaves(state, take)
        shards: list[_Shard] = []
        size = 0
        for item, entry in zip(items, index, strict=True):
            if not shards or (shards[-1].items and size + item.size > limit):
                shards.append(_Shard(shard_name(len(shards)), []))
                size = 0
            shards[-1].items.append(item)
            size += item.size
            entry[1] = shards[-1].name
        return shards, skeleton, index

    @staticmethod
    def _stage(staging: Staging, shard: _Shard, devices: set[torch.device]) -> None:
        offset = shard.offset
        assert offset is not None
        for item in shard.items:
            source = item.tensor
            target = staging.view(offset, item.size).view(source.dtype).view(source.shape)
            target.copy_(source, non_blocking=source.is_cuda)
            if source.is_cuda:
                devices.add(source.device)
            item.tensor = target
            offset += aligned(item.size)

    def emit(self, pending: Pending, shard: _Shard) -> None:
        """Put one shard on disk: linked to the previous checkpoint's identical file, or written."""
        items = shardfile.ordered(shard.items)
        final = pending.directory / shard.name
        previous = pending.previous.get(shard.name)
        size = shardfile.file_size(items)
        comparable = previous is not None and previous.size == size and fmt.tree_entry(previous.entry)
        if comparable and self._unchanged_before.get(shard.name, True):
            sha, singles = shardfile.digest(items)
            if sha == previous.sha256 and _link(previous, final, self.share_limit):
                pending.result.linked += size
            else:
                pending.syncs.append(_write(final, items, hashed=False)[2])
                pending.result.written += size
        else:
            sha, singles, synced = _write(final, items)
            pending.syncs.append(synced)
            pending.result.written += size
        if comparable:
            self._unchanged_before[shard.name] = sha == previous.sha256
        pending.result.files[shard.name] = {"size": size, "sha256": sha, fmt.DIGEST: treehash.KIND}
        for item in items:
            if item.digest:  # covered by the training-state fingerprint
                path, tensor = pending.paths_of[item.name]
                pending.lines.append(fpr.line(path, tensor, singles[item.name]))
        self.faults.between_shards()

    # -- reading -------------------------------------------------------------------------------------
    def read(self, directory: Path, manifest: dict[str, Any],
             located: dict[tuple[Any, ...], tuple[str, str]] | None = None) -> dict[str, Any]:
        """The state; ``located`` (when given) receives where each tensor came from: path -> (shard, key)."""
        deadline = Deadline(self.load_timeout_s, directory)
        meta = fmt.load_payload(directory / META)
        deadline.check(META, "in torch.load")
        check_structure(meta, META, deadline)  # before anything walks it
        if not isinstance(meta, dict) or meta.get("kind") != KIND or not isinstance(meta.get("tensors"), list):
            raise fmt.InvalidCheckpoint(f"{META} is not the index of a sharded checkpoint")
        listed = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
        wanted: dict[str, list[list[Any]]] = {}
        for entry in meta["tensors"]:
            if not (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[0], list)
                    and isinstance(entry[1], str) and isinstance(entry[2], str)):
                raise fmt.InvalidCheckpoint(f"{META}: an index entry is malformed ({str(entry)[:80]})")
            if entry[1] not in listed or paths.name_problem(entry[1]) is not None:
                raise fmt.InvalidCheckpoint(f"{META} names {entry[1]!r}, which the manifest does not list")
            wanted.setdefault(entry[1], []).append(entry)
        found: dict[tuple[Any, ...], torch.Tensor] = {}
        for name in sorted(wanted):
            try:
                tensors = shardfile.read(directory / name)
            except shardfile.BadShard as e:
                raise fmt.InvalidCheckpoint(str(e)) from None
            except paths.NotRegularFile as e:
                raise fmt.InvalidCheckpoint(f"{name} is {e.kind}, not a regular file") from None
            except (OSError, RuntimeError) as e:
                raise fmt.InvalidCheckpoint(f"{name} cannot be read ({e})") from e
            deadline.check(name, "mapping its tensors")
            for path, _, key, shape, stride in wanted[name]:
                if key not in tensors:
                    raise fmt.InvalidCheckpoint(f"{name} lacks the tensor {key!r} that {META} lists")
                try:
                    found[tuple(path)] = _rebuild(tensors[key], shape, stride)
                except (TypeError, ValueError) as e:
                    raise fmt.InvalidCheckpoint(f"{META}: the entry of {key!r} is malformed ({e})") from None
                if located is not None:
                    located[tuple(path)] = (name, key)
        return _fill(meta.get("tree"), found)


def _rebuild(flat: torch.Tensor, shape: Any, stride: Any) -> torch.Tensor:
    if stride is None:
        return flat
    if not (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in shape + stride)):
        raise ValueError(f"shape {shape!r} and strides {stride!r} do not match")
    extent = 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True)) if math.prod(shape) else 0
    if flat.dim() != 1 or extent > flat.numel():
        raise ValueError(f"strides {stride} reach past the {flat.numel()} stored elements")
    return flat.as_strided(shape, stride)


def _fill(tree: Any, found: dict[tuple[Any, ...], torch.Tensor]) -> dict[str, Any]:
    """The skeleton with every indexed tensor put back; every index path must name a None leaf of it."""
    if not isinstance(tree, dict):
        raise fmt.InvalidCheckpoint(f"{META} holds a {type(tree).__name__}, not a checkpoint")

    def put(path: tuple[Any, ...], leaf: Any) -> Any:
        if path not in found:
            return leaf
        if leaf is not None:
            raise fmt.InvalidCheckpoint(f"{META}: {path_text(path)} is indexed but holds a value")
        return found.pop(path)

    state = map_leaves(tree, put)
    if found:
        raise fmt.InvalidCheckpoint(f"{META}: the index names {path_text(next(iter(found)))}, which is not in the "
                                    f"state")
    return state


class _Sync(threading.Thread):
    """A shard's fsync and rename, on a thread of its own that ends with them (nothing stays running after a save)."""

    def __init__(self, handle: Any, tmp: Path, final: Path) -> None:
        super().__init__(name="resumable-fsync", daemon=True)
        self.handle, self.tmp, self.final = handle, tmp, final
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            try:
                os.fsync(self.handle.fileno())
            finally:
                self.handle.close()
            os.replace(self.tmp, self.final)
        except BaseException as e:  # noqa: BLE001 - raised by result() on the thread that waits
            self.error = e

    def result(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


def _write(final: Path, items: list[Item], hashed: bool = True) -> tuple[str, dict[str, str], _Sync]:
    """Write a shard atomically (temp file, fsync, rename); with ``hashed``, its tree digest and its tensors'
    digests, hashed from the bytes on their way to the file. Returns once every byte is written and hashed (no
    tensor is read after); the fsync and rename go on on another thread (the _Sync), so the disk's flush of one
    shard overlaps the hashing of its last pieces and the writing of the next shard."""
    tmp = fmt.tmp_path(final)
    handle = fmt.create_new(tmp, "wb")
    try:
        found = shardfile.write(handle, items, hashed=hashed)
        handle.flush()
    except BaseException:
        handle.close()
        raise
    synced = _Sync(handle, tmp, final)
    try:
        sha, singles = found() if found is not None else ("", {})
    except BaseException:
        synced.join()
        raise
    return sha, singles, synced


def _link(previous: Previous, final: Path, share_limit: int | None = None) -> bool:
    """Hard-link ``final`` to the previous checkpoint's identical file; False where that must not or cannot be done,
    and the caller writes it instead: the file is shared by ``share_limit`` checkpoints already (redundancy), it no
    longer holds the bytes its manifest promised (damaged since: linking would copy the damage into the new
    checkpoint), or links are impossible (another file system, a mount without links)."""
    try:
        found = paths.regular_stat(previous.path)
        if found.st_size != previous.size or (share_limit is not None and found.st_nlink >= share_limit):
            return False
        if fmt.file_digest(previous.path, previous.entry) != previous.sha256:
            return False
        tmp = fmt.tmp_path(final)
        tmp.unlink(missing_ok=True)
        os.link(previous.path, tmp, follow_symlinks=False)
        os.replace(tmp, final)
    except OSError:
        return False
    return True
