"""Whether the disk where checkpoints go has room for one more, the last checkpoint's size being the estimate: a start
that cannot save is refused with the figures, and a save that will probably fail (ENOSPC) is announced."""

from __future__ import annotations

import shutil
from pathlib import Path

from ... import log
from ...errors import ResumableError


def free_bytes(root: Path, needed: int) -> int | None:
    """Free bytes at ``root``, when there is a size to compare with (``needed`` > 0) and the disk answers."""
    if not needed:
        return None
    try:
        return shutil.disk_usage(root).free
    except OSError:
        return None


def check(root: Path, needed: int) -> None:
    """At start: ResumableError when ``root`` cannot hold ``needed`` more bytes (nothing is changed)."""
    free = free_bytes(root, needed)
    if free is not None and free < needed:
        raise ResumableError(f"{root} has {free / 1e6:.1f} MB free and a checkpoint needs {needed / 1e6:.1f} MB: free "
                             f"some space (or lower --keep) and run again; nothing was changed")


def warn_if_short(root: Path, needed: int) -> None:
    """Before a save: a warning when ``root`` has less than ``needed`` bytes and a margin free."""
    free = free_bytes(root, needed)
    if free is not None and free < needed * 1.2:
        log.warning(f"only {free / 1e6:.0f} MB free in {root}, and a checkpoint takes {needed / 1e6:.0f} MB: the next "
                    f"save may fail (free space, or lower --keep)")
