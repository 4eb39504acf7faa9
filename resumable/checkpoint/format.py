"""On-disk checkpoint format: payload files, ``manifest.json`` written last, integrity checks.

Layout::

    RUN_DIR/checkpoints/step-000001234/
        shard-00000.safetensors ...  the state's tensors (formats 3 and 4, see sharded.py)
        meta.pt                      everything else, and where each tensor is (weights_only loadable)
        state.pt                     formats 1 and 2 instead: torch.save of the whole state (weights_only loadable)
        manifest.json                format version, step, size and digest of every file, fingerprint, config

A directory is a checkpoint only if its manifest parses, has a known format version, and every file it
lists exists with the recorded size and digest. An entry's digest (its ``"sha256"`` field) is the sha256 of the
file's bytes, or, for a format 4 shard (``"digest": "sha256-tree"``), its tree digest (treehash.py), computed from
the same bytes by :func:`file_digest`, which every check of a file against its entry uses. The manifest is
replaced atomically (temp file, fsync, ``os.replace``, fsync of the directory), so a kill at any instant leaves
either no manifest or a complete one.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import pickle
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..atomic import TMP_MARK, create_new, fsync_dir, replace_with, tmp_path, write_json_atomic  # noqa: F401 - fmt.* for checkpoint/
from . import paths, shardfile, treehash

FORMAT_NAME = "resumable-checkpoint"
# 4: shards carry a tree digest (treehash.py, marked "digest": "sha256-tree" in their entries); 3: sharded safetensors
# payload; 2: the manifest carries manifest_sha256; 1 to 3 are read
FORMAT_VERSION = 4
DIGEST = "digest"  # a file entry's field naming how its "sha256" was computed (absent: sha256 of the file's bytes)
DIGESTS = (treehash.KIND,)  # the values this resumable knows
MANIFEST = "manifest.json"
PAYLOAD = "state.pt"
TRAIN_STATE = "train_state"  # the payload entry of the loop's position (step, epoch, batch), which the manifest repeats
POSITION = ("step", "epoch", "batch_in_epoch")
_CHUNK = 1 << 20


class InvalidCheckpoint(Exception):
    """A directory that is not a usable checkpoint; the message says why."""


class UnsafeCheckpoint(InvalidCheckpoint):
    """A payload that would need arbitrary unpickling to load."""


class HashingWriter:
    """File wrapper that hashes bytes as torch.save streams them, so the payload is read once."""

    def __init__(self, handle: io.BufferedWriter) -> None:
        self._handle = handle
        self.sha256 = treehash.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()


def write_payload(directory: Path, obj: Any, name: str = PAYLOAD) -> dict[str, Any]:
    """torch.save ``obj`` to ``directory/name`` atomically; returns ``{"size", "sha256"}``."""
    final = directory / name
    tmp = tmp_path(final)
    with create_new(tmp, "wb") as handle:
        writer = HashingWriter(handle)
        try:
            torch.save(obj, writer)
        except RuntimeError as e:
            # torch's zip writer reports a failed write (disk full, I/O error) as an opaque RuntimeError;
            # name the likely cause so the user knows what to fix.
            free = shutil.disk_usage(directory).free
            code = errno.ENOSPC if free < max(64 << 20, writer.size) else errno.EIO  # a short write: usually full
            raise OSError(code, f"{os.strerror(code)} while writing {final} ({free / 1e6:.0f} MB free): "
                                f"{' '.join(str(e).split())}") from e
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    return {"size": writer.size, "sha256": writer.sha256.hexdigest()}


def loadable_bytes(obj: Any) -> bytes:
    """``obj`` as torch.save writes it, once it has been read back with ``weights_only=True``: every commit must load
    (a value that needs arbitrary unpickling, such as a numpy scalar, raises StateNotLoadable naming its path)."""
    from ..errors import StateNotLoadable

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means the checkpoint could never be resumed
        where = _unsafe_leaf(obj)
        detail = " ".join(str(e).split())[:300]
        raise StateNotLoadable(
            f"the state of {where[0] if where else 'an object'} cannot be loaded back safely (weights_only)"
            + (f": {where[1]} is a {where[2]}" if where else "") + f" ({detail}). Return only tensors, numbers, "
            f"strings, None and lists/dicts of them from its state_dict() (e.g. convert numpy values with .item() "
            f"or torch.from_numpy); nothing was committed") from e
    return data


_PLAIN = (str, int, float, bool, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size, bytes)


def _unsafe_leaf(obj: Any, path: tuple[Any, ...] = ()) -> tuple[str, str, str] | None:
    """(object name, path, type) of the first leaf a weights_only load does not take, as a guess for the message."""
    if isinstance(obj, dict) or type(obj) in (list, tuple):
        children = obj.items() if isinstance(obj, dict) else enumerate(obj)
        return next((found for key, value in children if (found := _unsafe_leaf(value, (*path, key))) is not None),
                    None)
    if isinstance(obj, _PLAIN) and type(obj).__module__ in ("builtins", "torch"):
        return None
    names = [p for p in path if p not in ("tree",)]
    owner = repr(names[0]) if names else "the checkpoint"
    return owner, "/" + "/".join(map(str, names)), f"{type(obj).__module__}.{type(obj).__qualname__}"


def write_bytes_atomic(directory: Path, data: bytes, name: str) -> dict[str, Any]:
    """``data`` to ``directory/name`` atomically (temp file, fsync, rename; the manifest's commit fsyncs the folder);
    returns ``{"size", "sha256"}``."""
    replace_with(directory / name, data, sync_folder=False)
    return {"size": len(data), "sha256": treehash.sha256(data).hexdigest()}


def sha256_file(path: Path) -> str:
    """sha256 of a regular file (anything else raises OSError: a FIFO would block, /dev/zero never end)."""
    digest = treehash.sha256()
    with paths.open_regular(path) as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def tree_entry(entry: Any) -> bool:
    """Whether a manifest entry's "sha256" is a shard's tree digest (treehash.py) rather than the file's sha256."""
    return isinstance(entry, dict) and entry.get(DIGEST) == treehash.KIND


def digest_of(path: Path, entry: Any) -> tuple[str, treehash.FileDigests | None]:
    """A file's digest computed the way its manifest ``entry`` says (the tree digest of a shard, with its tensors'
    digests; else the sha256 of its bytes, and None). Raises OSError when it cannot be read, shardfile.BadShard when
    a shard's header is malformed."""
    if tree_entry(entry):
        found = shardfile.digest_file(path)
        return found.digest, found
    return sha256_file(path), None


def file_digest(path: Path, entry: Any) -> str:
    """A file's digest as its manifest ``entry`` records it ("" for a shard whose header is malformed, which
    matches nothing); OSError when it cannot be read. Every check of a file against its entry uses this."""
    try:
        return digest_of(path, entry)[0]
    except shardfile.BadShard:
        return ""


def verify_files(directory: Path, manifest: dict[str, Any], deep: bool = True) -> dict[str, treehash.FileDigests]:
    """Check every listed file's size (and digest when ``deep``); raises InvalidCheckpoint. Returns the tensor
    digests of every shard hashed by tree (``deep``), which a resume combines into the training-state fingerprint
    instead of hashing the loaded payload again.

    The manifest may come from anywhere (a shared folder, Drive), so its names must be plain names inside
    ``directory`` and each file a regular file, checked before it is opened (see paths.py)."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise InvalidCheckpoint("manifest.json lists no files")
    found: dict[str, treehash.FileDigests] = {}
    for name, expected in sorted(files.items(), key=lambda item: str(item[0])):
        try:
            path = directory / paths.plain_name(name, "manifest.json")
        except paths.UnsafePath as e:
            raise InvalidCheckpoint(str(e)) from None
        if not isinstance(expected, dict):
            raise InvalidCheckpoint(f"the manifest's entry for {name} is not an object with size and sha256")
        try:
            size = paths.regular_stat(path).st_size
        except FileNotFoundError:
            raise InvalidCheckpoint(f"{name} is missing") from None
        except paths.NotRegularFile as e:
            raise InvalidCheckpoint(f"{name} is {e.kind}, not a regular file; only regular files are read") from None
        except OSError as e:
            raise InvalidCheckpoint(f"{name} cannot be read ({e})") from None
        if size != expected.get("size"):
            raise InvalidCheckpoint(f"{name} has {size} bytes, the manifest says {expected.get('size')}")
        if not deep:
            continue
        try:
            digest, tensors = digest_of(path, expected)
        except paths.NotRegularFile as e:  # swapped after the check above
            raise InvalidCheckpoint(f"{name} is {e.kind}, not a regular file; only regular files are read") from None
        except shardfile.BadShard as e:
            raise InvalidCheckpoint(f"{name} does not match its sha256 (the file is corrupt: {e})") from None
        except OSError as e:
            raise InvalidCheckpoint(f"{name} cannot be read ({e})") from None
        if digest != expected.get("sha256"):
            raise InvalidCheckpoint(f"{name} does not match its sha256 (the file is corrupt)")
        if tensors is not None:
            found[name] = tensors
    return found


def load_payload(path: Path) -> Any:
    """Load a payload with ``weights_only=True``; anything needing arbitrary unpickling is refused.

    Only a regular file is loaded: it is opened with the path policy's checks (paths.open_regular) and torch
    maps that very file through /proc/self/fd, so a FIFO or link swapped in meanwhile is never read."""
    try:
        with paths.open_regular(path) as handle:
            # mmap: the payload's pages are shared by every process that loads it (N DDP ranks hold one copy)
            # and only the pages a tensor is copied from are read; the mapping outlives the descriptor.
            return torch.load(paths.fd_path(handle.fileno(), path), map_location="cpu", weights_only=True,
                              mmap=True)
    except paths.NotRegularFile as e:
        raise InvalidCheckpoint(f"{path.name} is {e.kind}, not a regular file; only regular files are read") \
            from None
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(f"{path} needs arbitrary unpickling to load and was refused for safety "
                               f"({str(e).splitlines()[0]})") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise InvalidCheckpoint(f"{path} cannot be read ({e})") from e


def _tensor_items(prefix: str, obj: Any) -> Iterable[tuple[str, torch.Tensor]]:
    """Tensors inside nested dicts/lists, in a fixed key order."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensor_items(f"{prefix}/{key}", obj[key])
    elif isinstance(obj, (list, tuple)):
        for index, item in enumerate(obj):
            yield from _tensor_items(f"{prefix}/{index}", item)


def fingerprint(model_state: dict[str, Any], optimizer_state: dict[str, Any] | None) -> str:
    """sha256 over the model and optimizer state tensors (names, dtypes, shapes, bytes) in key order.

    Two runs that reach the same training state have the same fingerprint, whatever the file bytes.
    """
    digest = hashlib.sha256()
    for name, tensor in _tensor_items("", {"model": model_state, "optimizer": optimizer_state or {}}):
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{data.dtype}|{tuple(tensor.shape)}|".encode())
        # A zero-copy view: hashlib releases the GIL on large buffers, so hashing in the writer thread
        # does not stall the training thread.
        digest.update(data.view(torch.uint8).numpy())
    return digest.hexdigest()
