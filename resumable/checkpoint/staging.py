"""Host memory of a bounded size that a checkpoint's shards are copied into, so training goes on while they are
written (``--staging-memory``).

The writer writes shards in the order they were staged and gives each region back when its shard is on disk, so
regions form a ring: handed out at the end, returned at the start. The buffer is allocated once, at the first
save, no larger than the state needs, and reused (later saves cost one memcpy and no page faults); it is pinned
when CUDA tensors are copied into it, so those copies are asynchronous.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

ALIGN = 64  # every region and every tensor in one starts 64-byte aligned (any dtype view is legal)


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for text in handle:
                if text.startswith("MemAvailable:"):
                    return int(text.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_budget() -> int:
    """Half of the host memory available now (1 GiB where that cannot be read)."""
    free = available_memory()
    return free // 2 if free is not None else 1 << 30


class Staging:
    """Up to ``capacity`` bytes of host buffer, handed out as FIFO regions."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"staging capacity {capacity} must be >= 0")
        self.capacity = capacity
        self._buffer: torch.Tensor | None = None
        self._regions: deque[tuple[int, int]] = deque()  # (offset, size), oldest first
        self._lock = threading.Lock()

    @property
    def allocated(self) -> int:
        return self._buffer.numel() if self._buffer is not None else 0

    def prepare(self, wanted: int, pinned: bool) -> None:
        """Before a save (nothing staged): make the buffer ``min(capacity, wanted)`` bytes, allocating only when
        that grows it or pinning is newly needed."""
        assert not self._regions, "the previous save still holds staged shards"
        size = min(self.capacity, aligned(wanted))
        if size <= 0:
            return
        pin = pinned and torch.cuda.is_available()
        if self._buffer is None or self._buffer.numel() < size or (pin and not self._buffer.is_pinned()):
            size = max(size, self.allocated)
            self._buffer = None  # the old buffer is freed before the new one is allocated
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)

    def reserve(self, size: int) -> int | None:
        """The offset of a free region of ``size`` bytes, or None when there is no room now."""
        size = aligned(size)
        with self._lock:
            total = self.allocated
            if size > total or size == 0:
                return None
            if not self._regions:
                offset: int | None = 0
            else:
                first = self._regions[0][0]
                newest, newest_size = self._regions[-1]
                end = newest + newest_size
                if newest >= first:  # not wrapped: free after the newest region, and before the oldest one
                    offset = end if end + size <= total else (0 if size <= first else None)
                else:  # wrapped: free between the newest region's end and the oldest one's start
                    offset = end if end + size <= first else None
            if offset is None:
                return None
            self._regions.append((offset, size))
            return offset

    def view(self, offset: int, size: int) -> torch.Tensor:
        assert self._buffer is not None
        return self._buffer[offset:offset + size]

    def release(self, offset: int) -> None:
        """Give back the oldest region (the writer finishes shards in the order they were staged)."""
        with self._lock:
            first = self._regions.popleft()
            assert first[0] == offset, "staged regions are released in the order they were reserved"

    def release_all(self) -> None:
        with self._lock:
            self._regions.clear()

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(size for _, size in self._regions)
