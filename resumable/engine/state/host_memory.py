"""How the process's C allocator treats the large blocks a CPU training step allocates and frees.

A CPU step of the MNIST CNN allocates and frees activation and gradient buffers of up to ~19 MB (conv2's output at
batch 128) every step. glibc's malloc serves blocks above its mmap threshold with a fresh ``mmap`` and returns them
with ``munmap`` (and trims the top of its heap back to the system), so every step page-faults tens of MB of zeroed
pages in again: 7.3 s of system time in a 2-epoch run on 2 cores. :func:`keep_freed_blocks` raises both thresholds,
so freed blocks stay in the heap and are reused: the compute floor of that CNN went from 834-1,043 to
1,194-1,341 samples/s (scripts/bench_throughput.py). Where a block lives never changes what is computed in it.

``resumable-train`` calls it when it trains on the CPU. It is a process-wide setting, so the library does not make
it inside a user's own process; a script may call it itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20  # blocks up to this size come from the heap, not from mmap
TRIM_THRESHOLD = 256 << 20  # freed memory at the heap's top is kept up to this much


def keep_freed_blocks() -> bool:
    """Keep large freed blocks in glibc's heap for reuse (see the module docstring). Returns whether the settings
    were made: False, changing nothing, where the C library is not glibc (macOS, musl) or refuses them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # glibc refuses an mmap threshold above half its largest heap (32 MB on some builds): then 32 MB, its own ceiling
    mapped = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 or mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
    return mapped and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
