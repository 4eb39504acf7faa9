"""Host memory of this process, for the figures a save or restore reports (Linux /proc; None elsewhere).

The peak is the kernel's high-water mark (``VmHWM``), which writing ``5`` to ``/proc/self/clear_refs`` resets
to the current size, so the peak of one restore can be measured exactly rather than sampled.
"""

from __future__ import annotations

import os
import time


def rss() -> int | None:
    """Resident bytes now."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def proc_field(path: str, key: str) -> int | None:
    """The ``key:`` line of a /proc file such as /proc/meminfo, in bytes (its values are in kB)."""
    try:
        with open(path, encoding="ascii") as handle:
            for line in handle:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak() -> int | None:
    """The highest resident bytes since the last :func:`reset_peak` (or since the process started)."""
    return proc_field("/proc/self/status", "VmHWM")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """``with PeakMemory() as m: ...`` then ``m.added``: how far above its start resident memory rose inside the
    block (None where it cannot be measured), and ``m.seconds``."""

    def __enter__(self) -> PeakMemory:
        self.exact = reset_peak()
        self.start = rss()
        self.began = time.perf_counter()
        self.added: int | None = None
        self.seconds = 0.0
        return self

    def __exit__(self, *_: object) -> None:
        self.seconds = time.perf_counter() - self.began
        top = peak() if self.exact else None
        if top is not None and self.start is not None:
            self.added = max(top - self.start, 0)
