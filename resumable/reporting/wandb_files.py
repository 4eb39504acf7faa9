"""What an offline W&B run already holds: the steps in its ``.wandb`` files (read without importing wandb).

``wandb`` offline writes each session of a run to ``WANDB_DIR/wandb/offline-run-<time>-<id>/run-<id>.wandb``,
a transaction log in LevelDB's log format: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB
blocks of chunks, each ``crc32(type + data)`` (uint32), length (uint16), type (1 full, 2 first, 3 middle, 4
last), data: one serialized ``Record`` protobuf. wandb-core buffers this file (it writes when a block fills,
every ``x_transaction_log_flush_interval`` seconds and at ``finish()``), so a session killed with SIGKILL leaves
only a prefix of what it logged. Reading the files back is the only way to know which steps W&B really has;
a torn or damaged tail ends the read (GUIDE 13: never a traceback).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
_BLOCK = 32 * 1024
_CHUNK = struct.Struct("<IHB")  # crc32, length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[bytes]:
    """The serialized records of one ``.wandb`` file, up to its first torn or damaged chunk."""
    data = Path(path).read_bytes()
    if not data.startswith(_HEADER):
        return
    pos, parts = len(_HEADER), None
    while pos + _CHUNK.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK.size:  # the block's tail is padding
            pos += left
            continue
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding up to the next block
            pos += left
            continue
        body = data[pos + _CHUNK.size:pos + _CHUNK.size + length]
        if len(body) < length or zlib.crc32(bytes([kind]) + body) != crc:
            return  # a torn tail (a kill in the middle of a write) or damage: what came before is all there is
        pos += _CHUNK.size + length
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            parts = [body]
        elif kind in (_MIDDLE, _LAST) and parts is not None:
            parts.append(body)
            if kind == _LAST:
                yield b"".join(parts)
                parts = None
        else:
            return


def history(path: Path) -> Iterator[dict[str, Any]]:
    """The history rows of one ``.wandb`` file (``_step`` and the logged keys), in order."""
    import json

    from wandb.proto import wandb_internal_pb2 as pb  # only called where wandb is installed

    for data in records(path):
        record = pb.Record()
        try:
            record.ParseFromString(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError; a damaged record ends the read
            return
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            try:
                row[key] = json.loads(item.value_json)
            except ValueError:
                continue
        if "_step" not in row:
            row["_step"] = record.history.step.num
        yield row


def offline_files(wandb_dir: Path, run_id: str, exclude: Path | None = None) -> list[Path]:
    """The ``.wandb`` files of the earlier offline sessions of run ``run_id`` (oldest first)."""
    found = []
    for folder in sorted(Path(wandb_dir).glob("offline-run-*")):
        if exclude is not None and folder.resolve() == Path(exclude).resolve():
            continue
        candidate = folder / f"run-{run_id}.wandb"
        if not candidate.is_symlink() and candidate.is_file():
            found.append(candidate)
    return found


def offline_history(wandb_dir: Path, run_id: str, after: int,
                    exclude: Path | None = None) -> tuple[int | None, dict[int, dict[str, Any]]]:
    """What the earlier offline sessions of ``run_id`` wrote: the highest step (None when they wrote none), and the
    rows of the steps after ``after`` (one row per step, as W&B merges them)."""
    last, rows = None, {}
    for path in offline_files(wandb_dir, run_id, exclude):
        try:
            for row in history(path):
                step = row.get("_step")
                if not isinstance(step, int) or isinstance(step, bool):
                    continue
                last = step if last is None or step > last else last
                if step > after:
                    rows.setdefault(step, {}).update(row)
        except OSError:
            continue  # an unreadable file holds nothing we can count on
    return last, rows
