"""Proof by content that a resumed run reads the data an uninterrupted one would have read next.

A data position restored from a checkpoint proves only that the position was restored, not that the data
source honours it: a Hugging Face stream's ``state_dict()`` leaves its shuffle buffer out (the buffer is refilled
on load, so samples are lost and repeated), and any ``load_state_dict`` may resume somewhere else. So at every
save each rank records a digest of what its data will produce next (:func:`upcoming`), and after a resume the
first batch the data actually produces is digested and compared (:func:`first_batch_problem`): a mismatch stops
the run with :class:`~resumable.errors.ResumeNotApplied` naming the data source, before that batch is trained.

What is digested: for map-style data the next batch's sample indices (the order is a pure function of the seed
and the epoch, computed without loading anything); for a stream the next batch itself, which the loop has
already read (it reads one batch ahead to know an epoch's last). A stream's position at an epoch boundary is
its start, which no state holds, so there is nothing to record there. The digest covers tensors (dtype, shape,
bytes; 1 MiB of evenly spaced blocks of one over 4 MiB), NumPy arrays, numbers, strings and containers of them;
other objects count by type only.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch


def digest(value: Any) -> str:
    """A short hex digest of a batch (or of sample indices), equal for equal content wherever it lives."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, value)
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(_sampled(t.reshape(-1).view(torch.uint8)).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        h.update(f"A{value.dtype}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        h.update(b"{")
        for key in sorted(value, key=str):
            h.update(repr(key).encode())
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for item in value:
            _feed(h, item)
        h.update(b"]")
    elif value is None or isinstance(value, (bool, int, float, str, bytes, np.generic)):
        h.update(repr(value).encode())
    else:  # an object whose repr may hold an address: its type is all that compares
        h.update(type(value).__qualname__.encode())


_WHOLE = 4 << 20  # bytes of a tensor digested whole; a larger one (a big image batch) is sampled
_BLOCKS, _BLOCK = 256, 4096  # evenly spaced blocks of a sampled tensor (1 MiB): another batch differs in most


def _sampled(data: torch.Tensor) -> torch.Tensor:
    """``data`` (bytes), or evenly spaced blocks of it when it is large: a digest at a save costs ~1 ms, not a
    pass over a 150 MB batch, and still tells a lost or repeated sample (other bytes nearly everywhere)."""
    if data.numel() <= _WHOLE:
        return data
    starts = torch.linspace(0, data.numel() - _BLOCK, _BLOCKS, dtype=torch.float64).long()
    return data[(starts[:, None] + torch.arange(_BLOCK)[None, :]).reshape(-1)]


def upcoming(source: Any, epoch: int, batch: int) -> dict[str, Any] | None:
    """The record of what ``source`` (a sampler or a stream) produces first from position (epoch, batch), for a
    checkpoint at that position; None where it is not known without reading ahead."""
    ahead = getattr(source, "upcoming", None)
    found = ahead(epoch, batch) if callable(ahead) else None
    if found is None:
        return None
    of, value = found
    return {"epoch": epoch, "batch": batch, "of": of, "digest": digest(value)}


def source_name(source: Any) -> str:
    """The data a sampler or stream reads, as the user knows it (its dataset's or loader's type, or the user's own
    sampler)."""
    named = getattr(source, "source_name", None)
    if isinstance(named, str):
        return named
    for name in ("dataset", "loader"):
        data = getattr(source, name, None)
        if data is not None:
            return type(data).__name__
    return "map-style data in the Run's sample order"


def valid_record(record: Any) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("epoch"), int) and isinstance(record.get("batch"), int)
            and isinstance(record.get("digest"), str) and isinstance(record.get("of"), str))


def first_batch_problem(record: dict[str, Any], source: str, epoch: int, batch: int, item: Any) -> str | None:
    """Why the batch the data produced at (epoch, batch) after a resume is not the one ``record`` says it would be
    (None: it is, or (epoch, batch) is not the recorded position); ``source`` names the data in the message."""
    if (epoch, batch) != (record["epoch"], record["batch"]) or digest(item) == record["digest"]:
        return None
    return (f"resume verification failed: the data ({source}) produced another batch at epoch {epoch}, "
            f"batch {batch} than the uninterrupted run would have (its {record['of']} differ from the "
            f"checkpoint's record of them): the data source did not resume at its saved position (a state_dict() "
            f"that leaves out a shuffle buffer or anything refilled on load, data that changed, or randomness "
            f"from a generator of its own instead of torch/random/numpy's global ones, which resumable seeds per "
            f"batch). Training on would lose and repeat samples. Give it a state_dict()/load_state_dict() that "
            f"restores the exact position, or remove them so that it is resumed by replay; nothing was trained "
            f"or changed on disk")
