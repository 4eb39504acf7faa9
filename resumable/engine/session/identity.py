"""What a session runs, as two short digests recorded in its start record (sessions.jsonl): ``code``, the source of
the script or notebook cells that built and iterated the Run (and defined the model's class), and ``config``, its
options. The crash-loop check (engine/rundir/crash_loop.py) only counts failed sessions that ran the same code and
config as this start: fixing a typo, or changing an option, is a new attempt, not the same failure again."""

from __future__ import annotations

import hashlib
import inspect
import json
import linecache
import sys
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any

DIGEST_CHARS = 16


def _digest(parts: Iterable[str]) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part.encode("utf-8", "surrogatepass"))
        hasher.update(b"\0")
    return hasher.hexdigest()[:DIGEST_CHARS]


def _source(filename: str) -> str:
    """The text of a script, module or notebook cell (IPython registers each cell with linecache); "" when unknown."""
    try:
        return "".join(linecache.getlines(filename))
    except Exception:  # noqa: BLE001 - an unreadable file only makes the digest less specific
        return ""


def caller_file(frame: FrameType | None) -> str | None:
    """The file (or notebook cell) of the first frame outside resumable, from ``frame`` outwards."""
    package = __name__.split(".")[0]
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == package:
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else None


def class_file(obj: Any) -> str | None:
    """Where the class of ``obj`` is defined (a module file, or the notebook cell that defined it)."""
    try:
        return inspect.getsourcefile(type(obj)) or inspect.getfile(type(obj))
    except (TypeError, OSError):
        return None


def code_digest(files: Iterable[str | None]) -> str:
    """Digest of the sources of ``files`` (duplicates and unknown ones left out) and of the main script."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    names = sorted({name for name in (*files, main) if name})
    return _digest(f"{name}\n{_source(name)}" for name in names)


def config_digest(settings: Mapping[str, Any]) -> str:
    """Digest of the options as JSON records them."""
    return _digest([json.dumps(settings, sort_keys=True, default=str)])
