"""Files replaced atomically: a temp file beside the target, written (and fsynced), then renamed over it, so a
reader or a process killed at any instant sees the old content or the complete new one, never a mix. The one
implementation behind manifests, lock and lease records, the planned-stop marker and rewritten logs."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

TMP_MARK = ".tmp-"  # in every temp file's name: what a start removes as left over by a killed writer


def tmp_path(path: Path, tag: str | int | None = None) -> Path:
    """The temp file for ``path``: ``.NAME.tmp-TAG`` (default tag: this process's pid)."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid() if tag is None else tag}")


def create_new(tmp: Path, mode: str) -> io.IOBase:
    """A new file at ``tmp`` for writing: whatever a killed save (or anyone) left there is unlinked first, and
    O_EXCL | O_NOFOLLOW make sure the write never goes through a link planted at that name."""
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                 0o644)
    return os.fdopen(fd, mode, **({"encoding": "utf-8"} if "b" not in mode else {}))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_by(path: Path, write: Callable[[BinaryIO], object], *, durable: bool = True,
               sync_folder: bool | None = None, tag: str | int | None = None) -> None:
    """Make ``path`` hold what ``write(handle)`` writes (``torch.save(obj, handle)``...). ``durable``: fsync the file
    before the rename and the folder after it (a record rewritten every few seconds, such as a heartbeat, skips both);
    ``sync_folder=False`` leaves the folder's fsync to the caller (a checkpoint's manifest commit does it once). The
    temp file never outlives a failure."""
    path = Path(path)
    tmp = tmp_path(path, tag)
    try:
        with create_new(tmp, "wb") as handle:
            write(handle)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable if sync_folder is None else sync_folder:
        fsync_dir(path.parent)


def replace_with(path: Path, data: bytes, **options: Any) -> None:
    """Make ``path`` hold ``data`` (see :func:`replace_by` for the options)."""
    replace_by(path, lambda handle: handle.write(data), **options)


def write_json_atomic(path: Path, data: Any, *, durable: bool = True, tag: str | int | None = None) -> None:
    """``data`` as JSON (indented, keys sorted) in ``path``, replaced atomically (see :func:`replace_with`)."""
    replace_with(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"), durable=durable, tag=tag)
