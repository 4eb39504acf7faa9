"""``manifest.json`` as a typed, validated record, and the self-checksum that guards it.

A run dir may be shared, synced, symlinked or bit-rotted, so nothing in a manifest is trusted unchecked
(GUIDE 13): :func:`read` checks the file (a regular file of bounded size), its JSON (bounded nesting), its
self-checksum, and the type and range of every field the engine acts on, once, here. Anything wrong raises
:class:`InvalidCheckpoint` with the reason: that checkpoint is skipped like a corrupt payload, and the
previous valid one is used. The rest of the engine can then read the manifest's fields without checking them.

Format 2 adds ``manifest_sha256``: the sha256 of the manifest's canonical JSON (sorted keys, no spaces, ASCII)
without that field. Every payload file was already guarded by its sha256; this guards the manifest itself,
so a flipped value (a thread count, a config value, a size) is "manifest corrupted" instead of being obeyed.
Format 1 manifests have no self-checksum; they are still read (their fields are validated all the same) and
``inspect``/``verify`` say so.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import format as fmt
from . import paths
from .layout import step_of

CHECKSUM_FIELD = "manifest_sha256"
FIRST_SEALED_VERSION = 2  # format 1 manifests have no self-checksum
# Limits far above any real manifest (a few KB), so that a hostile or damaged one costs little to refuse:
# reading is bounded by MAX_BYTES and walking by MAX_DEPTH (json would raise RecursionError on deep input).
MAX_BYTES = 4 << 20
MAX_DEPTH = 32
MAX_FILES = 4096
_MAX_INT = 2**63 - 1  # what a 64-bit counter or file size can hold
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. ``body`` is the JSON object as written: what ``CheckpointInfo.manifest`` holds and
    what older code reads by key; the typed fields are the same values, checked."""

    body: dict[str, Any]
    format_version: int
    step: int
    files: dict[str, FileEntry]
    created_unix: float
    epoch: int | None
    batch_in_epoch: int | None
    num_threads: int | None
    fingerprint: str | None
    world_size: int
    run_id: str | None

    @property
    def sealed(self) -> bool:
        """Whether the manifest carried (and passed) its self-checksum; format 1 ones do not have one."""
        return CHECKSUM_FIELD in self.body


def canonical_sha256(body: dict[str, Any]) -> str:
    """sha256 of ``body``'s canonical JSON without the checksum field (independent of indentation and order)."""
    content = {k: v for k, v in body.items() if k != CHECKSUM_FIELD}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def seal(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as it will read back from JSON, with its ``manifest_sha256`` added.

    The round trip first makes the checksum cover exactly what a reader will parse: tuples become lists and
    non-string keys become strings, which would otherwise hash differently at write and at read."""
    plain = json.loads(json.dumps({k: v for k, v in body.items() if k != CHECKSUM_FIELD}))
    return {**plain, CHECKSUM_FIELD: canonical_sha256(plain)}


def note(body: dict[str, Any] | None) -> str | None:
    """What ``inspect``/``verify`` add for a readable manifest: None, or why it is checked less than others."""
    if isinstance(body, dict) and CHECKSUM_FIELD not in body and body.get("format_version") == 1:
        return "format 1: its manifest has no self-checksum (written by an older resumable), fields checked only"
    return None


# -- reading ------------------------------------------------------------------------------------------
def read(directory: Path) -> Manifest:
    """Read and validate ``directory/manifest.json``; raises InvalidCheckpoint naming the problem.

    The step must be the one in the folder's name when the folder is named for a step (layout.py)."""
    return parse(_read_bytes(Path(directory) / fmt.MANIFEST), step_of(Path(directory).name))


def _read_bytes(path: Path) -> bytes:
    """The manifest's bytes, opened only if it is a regular file (paths.py: a FIFO would block, a device never
    end, a link read someone else's file), and at most MAX_BYTES of them."""
    try:
        with paths.open_regular(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > MAX_BYTES:
                raise fmt.InvalidCheckpoint(f"manifest.json has {size} bytes, more than the {MAX_BYTES} a manifest "
                                            f"may have (not one resumable wrote)")
            data = handle.read(MAX_BYTES + 1)
    except paths.NotRegularFile as e:
        raise fmt.InvalidCheckpoint(f"manifest.json is {e.kind}, not a regular file; resumable opens only regular "
                                    f"files in a run dir (put the real file there, or remove the checkpoint)") from None
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise fmt.InvalidCheckpoint("no manifest.json (the save did not finish)") from None
        raise fmt.InvalidCheckpoint(f"manifest.json is unreadable ({e})") from e
    if len(data) > MAX_BYTES:  # it grew after the fstat
        raise fmt.InvalidCheckpoint(f"manifest.json is larger than the {MAX_BYTES} bytes a manifest may have")
    return data


def parse(data: bytes, step: int | None = None) -> Manifest:
    """Validate a manifest's bytes (``step``: the step its folder is named for, when known)."""
    try:
        body = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise fmt.InvalidCheckpoint(f"manifest.json names {_show(e.key)} twice in one object (JSON keeps the last: "
                                    f"not a manifest resumable wrote)") from None
    except UnicodeDecodeError as e:
        raise fmt.InvalidCheckpoint(f"manifest.json is unreadable (not UTF-8: {e.reason} at byte {e.start})") from e
    except RecursionError:
        raise fmt.InvalidCheckpoint(f"manifest.json is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as e:  # JSONDecodeError, or an integer of thousands of digits
        raise fmt.InvalidCheckpoint(f"manifest.json is unreadable ({e})") from e
    if _too_deep(body):
        raise fmt.InvalidCheckpoint(f"manifest.json is nested more than {MAX_DEPTH} levels deep")
    if not isinstance(body, dict) or body.get("format") != fmt.FORMAT_NAME:
        raise fmt.InvalidCheckpoint("manifest.json is not a resumable manifest")
    version = body.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise fmt.InvalidCheckpoint(f"manifest.json field 'format_version' is {_show(version)}: not a format "
                                    f"version resumable knows")
    if version > fmt.FORMAT_VERSION:
        raise fmt.InvalidCheckpoint(f"format version {version} is newer than this resumable understands "
                                    f"({fmt.FORMAT_VERSION}); upgrade resumable to load it")
    _check_seal(body, version)
    for name, (check, required) in _FIELDS.items():
        if name not in body:
            if required:
                raise fmt.InvalidCheckpoint(f"manifest.json lacks the required field {name!r}")
            continue
        problem = check(body[name])
        if problem is not None:
            raise fmt.InvalidCheckpoint(f"manifest.json field {name!r} is {_show(body[name])}: {problem}")
    if step is not None and body["step"] != step:
        raise fmt.InvalidCheckpoint(f"manifest says step {body['step']}, but its folder is step {step}")
    for name, entry in body["files"].items():
        if "folder" in entry and step_of(entry["folder"]) >= body["step"]:
            raise fmt.InvalidCheckpoint(f"manifest.json places {name!r} in {entry['folder']}, which is not an older "
                                        f"checkpoint's folder (a reused file always comes from an older one)")
    return Manifest(
        body=body, format_version=version, step=body["step"],
        files={name: FileEntry(entry["size"], entry["sha256"]) for name, entry in body["files"].items()},
        created_unix=float(body["created_unix"]), epoch=body.get("epoch"),
        batch_in_epoch=body.get("batch_in_epoch"), num_threads=body.get("num_threads"),
        fingerprint=body.get("fingerprint"), world_size=body.get("world_size", 1), run_id=body.get("run_id"))


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when it names a key twice (a file listed twice would be checked once)."""
    body: dict[str, Any] = {}
    for key, value in pairs:
        if key in body:
            raise _DuplicateKey(key)
        body[key] = value
    return body


def _check_seal(body: dict[str, Any], version: int) -> None:
    """Before the fields: a damaged manifest is reported as corrupted, whatever field the damage hit."""
    recorded = body.get(CHECKSUM_FIELD)
    if recorded is None and CHECKSUM_FIELD not in body:
        if version >= FIRST_SEALED_VERSION:
            raise fmt.InvalidCheckpoint(f"manifest corrupted: a format {version} manifest must carry "
                                        f"{CHECKSUM_FIELD} and this one has none")
        return
    if not isinstance(recorded, str) or not _HEX64.fullmatch(recorded):
        raise fmt.InvalidCheckpoint(f"manifest corrupted: {CHECKSUM_FIELD} is {_show(recorded)}, not a sha256")
    if canonical_sha256(body) != recorded:
        raise fmt.InvalidCheckpoint("manifest corrupted: its content does not match its manifest_sha256 "
                                    "(manifest.json was damaged or edited after it was written)")


def _too_deep(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def _show(value: Any) -> str:
    """A short rendering of a bad value for a one-line reason."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- field checks: each returns None when the value is fine, else what it must be ----------------------
Check = Callable[[Any], "str | None"]


def _integer(low: int, high: int = _MAX_INT) -> Check:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            return f"must be an integer from {low} to {high}" if high != _MAX_INT else \
                f"must be an integer >= {low}"
        return None
    return check


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: Any) -> str | None:
    return None if _finite(value) else "must be a finite number"


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) and len(value) <= 4096 else "must be a string (at most 4096 characters)"


def _mapping(value: Any) -> str | None:
    return None if isinstance(value, dict) else "must be an object"


def _hex64(value: Any) -> str | None:
    return None if isinstance(value, str) and _HEX64.fullmatch(value) else "must be 64 lowercase hex digits"


def _metrics(value: Any) -> str | None:
    if not isinstance(value, dict):
        return "must be an object of metric name -> number"
    bad = next((k for k, v in value.items() if v is not None and not _finite(v)), None)
    return None if bad is None else f"metric {bad!r} must be a finite number or null"


def _file_name_problem(name: Any) -> str | None:
    """The path policy's plain-name rule (paths.py), plus what the format reserves: the manifest's own name and
    the temp-file mark of an unfinished write."""
    problem = paths.name_problem(name)
    if problem is None and (name == fmt.MANIFEST or fmt.TMP_MARK in name):
        problem = "a name the format reserves"
    return problem


def _files(value: Any) -> str | None:
    if not isinstance(value, dict) or not 0 < len(value) <= MAX_FILES:
        return f"must be an object of 1 to {MAX_FILES} file name -> {{size, sha256}}"
    for name, entry in value.items():
        problem = _file_name_problem(name)
        if problem is not None:
            return f"file name {_show(name)} is not a plain name inside the checkpoint's folder ({problem})"
        if not isinstance(entry, dict):
            return f"the entry of {name!r} must be an object with size and sha256"
        if _integer(0)(entry.get("size")) is not None:
            return f"the size of {name!r} must be an integer >= 0"
        if _hex64(entry.get("sha256")) is not None:
            return f"the sha256 of {name!r} must be 64 lowercase hex digits"
        if fmt.DIGEST in entry and entry[fmt.DIGEST] not in fmt.DIGESTS:
            return (f"the digest of {name!r} is {_show(entry[fmt.DIGEST])}, which this resumable does not know "
                    f"(known: {', '.join(fmt.DIGESTS)}): written by a newer resumable; upgrade resumable to load it")
        if "folder" in entry and not _placement_ok(entry["folder"]):
            return f"the folder of {name!r} must be the name of a checkpoint folder (step-N, checkpoint-N)"
    return None


def _placement_ok(folder: Any) -> bool:
    """A remote manifest may place a file in an older checkpoint's folder (storage/tiered.py reuses a shard
    already durable there instead of uploading it again); that folder must be a plain checkpoint folder name
    (``step-N``, ``checkpoint-N``)."""
    return isinstance(folder, str) and step_of(folder) is not None and paths.name_problem(folder) is None


def _frozen(value: Any) -> str | None:
    """The tensors not stored (engine/state/frozen.py): name -> {sha256, shape, dtype}."""
    if not isinstance(value, dict):
        return "must be an object of tensor name -> {sha256, shape, dtype}"
    for name, entry in value.items():
        if not (isinstance(entry, dict) and _hex64(entry.get("sha256")) is None and isinstance(entry.get("dtype"), str)
                and isinstance(entry.get("shape"), list)
                and all(_integer(0)(d) is None for d in entry["shape"])):
            return f"the entry of {_show(name)} must be {{sha256, shape, dtype}}"
    return None


def _capability(value: Any) -> str | None:
    ok = isinstance(value, list) and len(value) == 2 and all(_integer(0, 99)(v) is None for v in value)
    return None if ok else "must be [major, minor], two integers from 0 to 99"


def _amp_dtype(value: Any) -> str | None:
    return None if value in ("none", "bf16", "fp16") else "must be none, bf16 or fp16"


def _config(value: Any) -> str | None:
    """The options a later start inherits (``resumable-train``'s): each known one of the type it must have, so that a
    wrong one is a corrupt checkpoint to fall back from, not a traceback when the next session is built."""
    if not isinstance(value, dict):
        return "must be an object"
    from ..config import option_type_problem  # a leaf module: the options' own types

    for name, option in value.items():
        problem = option_type_problem(name, option)
        if problem is not None:
            return f"option {_show(name)} is {_show(option)}: {problem}"
    return None


def _names(value: Any) -> str | None:
    ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    return None if ok else "must be a list of parameter names"


# name -> (check, required). Fields not listed (and future ones) are allowed; the self-checksum covers them.
_FIELDS: dict[str, tuple[Check, bool]] = {
    "step": (_integer(0), True),
    "files": (_files, True),
    "created_unix": (_number, True),
    "epoch": (_integer(0), False),
    "batch_in_epoch": (_integer(0), False),
    "num_threads": (_integer(1, 4096), False),
    "fingerprint": (_hex64, False),
    "fingerprint_version": (_integer(1, 3), False),
    "frozen": (_frozen, False),
    "trainable": (_names, False),
    "metrics": (_metrics, False),
    "config": (_config, False),
    "computation": (_mapping, False),
    "determinism": (_mapping, False),
    "world_size": (_integer(1, 1 << 20), False),
    "run_id": (_text, False),
    "reason": (_text, False),
    "device": (_text, False),
    "created": (_text, False),
    "torch_version": (_text, False),
    "python_version": (_text, False),
    # where it was written (engine/state/hardware.py); absent in checkpoints before they were recorded
    "device_type": (_text, False),
    "gpu_name": (_text, False),
    "gpu_capability": (_capability, False),
    "cuda_version": (_text, False),
    "amp_dtype": (_amp_dtype, False),
    "cpu_capability": (_text, False),
}
