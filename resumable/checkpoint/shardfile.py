"""One safetensors file: written streaming from tensors in memory, read back memory-mapped.

The layout is the safetensors one (an 8-byte little-endian header length, a JSON header of ``{name: {dtype,
shape, data_offsets}}``, then the tensors' bytes back to back), so ``safetensors.safe_open`` reads our files. We
write it ourselves because the library's ``save_file`` first copies every tensor into a Python ``bytes`` (a
second host copy of the shard), and we need the bytes hashed before they are written (an unchanged shard is
linked, not rewritten) and one bounded bounce buffer for CUDA tensors.

Reading maps the file (``MAP_PRIVATE``) and returns views into it: nothing is copied until a tensor is loaded
into a model, and N processes that read one checkpoint share its pages. The header comes from disk, so it is
checked as strictly as the safetensors library does (known dtypes, sizes that match the shapes, offsets that
cover the data exactly once) before any view is made.

A tensor that is dense but not contiguous (``channels_last``, a transposed optimizer state) is stored flat, in
memory order, and rebuilt with its strides: fused optimizers read their state as raw memory laid out like the
parameter. Tensors are ordered by element size, largest first, so every tensor in the mapped file is aligned.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import paths, treehash

_CODES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
          "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
          "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
CODE_DTYPES: dict[str, torch.dtype] = {code: getattr(torch, name) for code, name in _CODES.items()
                                       if isinstance(getattr(torch, name, None), torch.dtype)}
DTYPE_CODES = {dtype: code for code, dtype in CODE_DTYPES.items()}
MAX_HEADER = 100 << 20  # the safetensors library's own bound
_CHUNK = 64 << 20  # bytes per device-to-host copy of a CUDA tensor written directly


def shardable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can live in a safetensors file (a plain strided tensor of a dtype it knows)."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided
            and not tensor.is_quantized and tensor.device.type != "meta" and tensor.dtype in DTYPE_CODES)


def _dense(tensor: torch.Tensor) -> bool:
    """Non-overlapping and without gaps: its elements fill ``numel`` consecutive slots of its storage."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(tensor.shape, tensor.stride(), strict=True) if s > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def stored_form(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int] | None]:
    """What goes into the file (a contiguous tensor, no copy where avoidable) and the strides that rebuild the
    original from it (None: it is stored with its own shape)."""
    tensor = tensor.detach()
    if tensor.is_contiguous() or tensor.numel() == 0:
        return (tensor if tensor.is_contiguous() else tensor.contiguous()), None
    if _dense(tensor):
        return tensor.as_strided((tensor.numel(),), (1,)), list(tensor.stride())
    return tensor.contiguous(), None  # overlapping or with gaps (a view): stored compact, like torch.save would


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class Item:
    """One tensor of a shard: its name in the file and its stored form (contiguous)."""

    name: str
    tensor: torch.Tensor
    digest: bool = False  # also hash it alone (the training-state fingerprint covers it)

    @property
    def size(self) -> int:
        return nbytes(self.tensor)


def ordered(items: list[Item]) -> list[Item]:
    """Largest element size first (stable), so every tensor starts aligned in the file."""
    return sorted(items, key=lambda item: -item.tensor.element_size())


def header(items: list[Item]) -> bytes:
    entries: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "resumable"}}
    offset = 0
    for item in items:
        entries[item.name] = {"dtype": DTYPE_CODES[item.tensor.dtype], "shape": list(item.tensor.shape),
                              "data_offsets": [offset, offset + item.size]}
        offset += item.size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def chunks(tensor: torch.Tensor, bounce: list[torch.Tensor | None] | None = None) -> Iterator[memoryview]:
    """The bytes of a contiguous tensor. A CPU tensor is one zero-copy view; a CUDA one is copied in chunks of
    64 MB through one reused host buffer (``bounce``), so writing it never needs a host copy of it all."""
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        if flat.numel():
            yield memoryview(flat.numpy())
        return
    holder = bounce if bounce is not None else [None]
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK]
        if holder[0] is None or holder[0].numel() < part.numel():
            holder[0] = torch.empty(min(_CHUNK, flat.numel()), dtype=torch.uint8, pin_memory=True)
        host = holder[0][:part.numel()]
        host.copy_(part)
        yield memoryview(host.numpy())


def file_size(items: list[Item]) -> int:
    return len(header(items)) + sum(item.size for item in items)


Digests = tuple[str, dict[str, str]]  # a file's tree digest and each of its tensors' (hex)


def _hashed(items: list[Item], write: Any = None) -> Callable[[], Digests]:
    """What waits for the tree digest (treehash.py) of the file these items make and each item's tensor digest, all
    queued on the pool; with ``write``, the file's bytes are also passed to it, each chunk while its pieces are
    hashed. Once this returns, no bounce buffer is in use (a CPU tensor's own memory is read until the wait)."""
    head = header(items)
    if write is not None:
        write(head)
    bounce: list[torch.Tensor | None] = [None]
    hashes = []
    for item in items:
        own = treehash.TensorHash()
        for view in chunks(item.tensor, bounce):
            pieces = own.add(view)
            if write is not None:
                write(view)
            if not item.tensor.is_cpu:
                treehash.wait(pieces)  # before the next chunk reuses the bounce buffer
        hashes.append(own)

    def result() -> Digests:
        raw = [own.digest() for own in hashes]
        return treehash.file_digest(head, raw), {item.name: value.hex() for item, value in zip(items, raw, strict=True)}

    return result


def digest(items: list[Item]) -> Digests:
    """(tree digest of the file these items make, each item's tensor digest), without writing anything."""
    return _hashed(items)()


def write(handle: Any, items: list[Item], hashed: bool = True) -> Callable[[], Digests] | None:
    """Write the file's bytes to an open binary ``handle``; with ``hashed``, returns what waits for what
    :func:`digest` returns, hashed from the very bytes written (on the pool, while the writing goes on: each byte is
    read once more, by a hashing thread). The caller may flush and sync the file before it waits."""
    if hashed:
        return _hashed(items, handle.write)
    handle.write(header(items))
    bounce: list[torch.Tensor | None] = [None]
    for item in items:
        for view in chunks(item.tensor, bounce):
            handle.write(view)
    return None


# -- reading -------------------------------------------------------------------------------------------
class BadShard(ValueError):
    """A file that is not a well-formed safetensors file; the message says what is wrong."""


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int


def parse_header(data: bytes, size: int) -> dict[str, Entry]:
    """The entries of a safetensors file of ``size`` bytes whose first bytes are ``data`` (at least the header);
    raises BadShard unless they describe the data region exactly."""
    if size < 8 or len(data) < 8:
        raise BadShard(f"{size} bytes: too short for a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    if length > MAX_HEADER or length > size - 8:
        raise BadShard(f"header length {length} does not fit the file ({size} bytes)")
    if len(data) < 8 + length:
        raise BadShard("the header was not read whole")
    try:
        body = json.loads(data[8:8 + length].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BadShard(f"the header is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadShard("the header is not a JSON object")
    base, entries, spans = 8 + length, {}, []
    for name, spec in body.items():
        if name == "__metadata__":
            continue
        if not isinstance(spec, dict) or spec.get("dtype") not in CODE_DTYPES:
            raise BadShard(f"tensor {name!r} has no dtype this reader knows")
        shape, offsets = spec.get("shape"), spec.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= 64
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise BadShard(f"tensor {name!r} has a bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise BadShard(f"tensor {name!r} has bad data_offsets {offsets!r}")
        dtype = CODE_DTYPES[spec["dtype"]]
        need = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if offsets[1] - offsets[0] != need or offsets[0] < 0:
            raise BadShard(f"tensor {name!r}: data_offsets {offsets} do not hold {need} bytes for shape {shape}")
        entries[name] = Entry(dtype, tuple(shape), base + offsets[0], base + offsets[1])
        spans.append((offsets[0], offsets[1]))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise BadShard(f"tensor data is not contiguous (a gap or overlap at byte {begin})")
        position = end
    if base + position != size:
        raise BadShard(f"the tensors hold {position} bytes but the file has {size - base} after its header")
    return entries


def _read_header(handle: Any, size: int, path: Path) -> tuple[bytes, dict[str, Entry]]:
    """The header bytes (length and JSON, as written) of the open safetensors file ``handle`` of ``size`` bytes, and
    its checked entries; BadShard, naming ``path``, when they do not describe the file."""
    head = handle.read(8)
    length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    if length <= MAX_HEADER and length <= size - 8:
        head += handle.read(length)
    try:
        entries = parse_header(head, size)
    except BadShard as e:
        raise BadShard(f"{path.name}: {e}") from None
    return head[:8 + length], entries


def read(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at ``path``, as views of a private memory map (only a regular file
    is opened: paths.open_regular)."""
    with paths.open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        _, entries = _read_header(handle, size, path)
        if not entries:
            return {}
        storage = torch.UntypedStorage.from_file(paths.fd_path(handle.fileno(), path), shared=False, nbytes=size)
    tensors = {}
    for name, entry in entries.items():
        # A storage of its own for each tensor (a view of the mapping), so every tensor starts at offset 0 of its
        # storage: some torch functions read a tensor's storage from its start (torch.set_rng_state crashes on
        # a view at an offset), and torch.load(mmap=True) gives the same shape of result.
        itemsize = torch.empty(0, dtype=entry.dtype).element_size()
        own = storage[entry.start:entry.end]
        if entry.start % itemsize:  # a file from elsewhere may be unaligned: copy that one tensor
            own = own.clone()
        tensors[name] = torch.empty(0, dtype=entry.dtype).set_(own, 0, entry.shape)
    return tensors


def digest_file(path: Path) -> treehash.FileDigests:
    """The tree digest (treehash.py) of the shard file at ``path``, with its tensors' digests, computed from the
    file alone. Only a regular file is opened (paths.open_regular); a malformed header raises BadShard, an unreadable
    file OSError. The tensors' bytes are read through a read-only mapping, their pieces hashed on the pool."""
    with paths.open_regular(path) as handle:
        stat = os.fstat(handle.fileno())
        size = stat.st_size
        head, entries = _read_header(handle, size, path)
        hashes = {name: treehash.TensorHash() for name in entries}  # header order: the order they were written in
        if size > len(head):
            try:  # private and read-only: what loading maps too (a FUSE mount with direct I/O refuses shared maps)
                mapped = mmap.mmap(handle.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
            except OSError:  # a file system that cannot map files at all: read the pieces instead
                _hash_by_reading(handle, entries, hashes)
            else:
                pieces: list[concurrent.futures.Future[bytes]] = []
                try:
                    with memoryview(mapped) as view:
                        for name, entry in entries.items():
                            pieces += hashes[name].add(view[entry.start:entry.end])
                finally:
                    concurrent.futures.wait(pieces)  # no piece reads the mapping once it is closed
                    del pieces
                    mapped.close()
    raw = {name: own.digest() for name, own in hashes.items()}
    return treehash.FileDigests(treehash.file_digest(head, raw.values()), {k: v.hex() for k, v in raw.items()},
                                treehash.identity(stat))


def _hash_by_reading(handle: Any, entries: dict[str, Entry], hashes: dict[str, treehash.TensorHash]) -> None:
    """Feed each tensor's bytes to its hash piece by piece, read from ``handle`` (no mapping)."""
    for name, entry in entries.items():
        handle.seek(entry.start)
        left = entry.end - entry.start
        while left:
            data = handle.read(min(treehash.PIECE, left))
            if not data:
                raise OSError(errno.EIO, f"the file ended {left} bytes early while it was hashed")
            hashes[name].add(memoryview(data))
            left -= len(data)
