"""Host memory of a bounded size that a checkpoint's shards are copied into, so training goes on while they are
written (``--staging-memory``).

One save at a time uses it (the writer waits for the previous save before the next begins): the training thread
hands out regions one after the other while it stages shards, and the whole buffer is free again once that save
has written them. The buffer is allocated once, at the first save, no larger than the state needs, and reused
(later saves cost one memcpy and no page faults); it is pinned when CUDA tensors are copied into it, so those
copies are asynchronous.
"""

from __future__ import annotations

import torch

from .memory import proc_field

ALIGN = 64  # every region and every tensor in one starts 64-byte aligned (any dtype view is legal)


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def default_budget() -> int:
    """Half of the host memory available now (1 GiB where that cannot be read)."""
    free = proc_field("/proc/meminfo", "MemAvailable")
    return free // 2 if free is not None else 1 << 30


class Staging:
    """Up to ``capacity`` bytes of host buffer, handed out as consecutive regions during one save."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"staging capacity {capacity} must be >= 0")
        self.capacity = capacity
        self._buffer: torch.Tensor | None = None
        self.in_use = 0  # bytes handed out to the save in progress

    @property
    def allocated(self) -> int:
        return self._buffer.numel() if self._buffer is not None else 0

    def prepare(self, wanted: int, pinned: bool) -> None:
        """Before a save (nothing staged): make the buffer ``min(capacity, wanted)`` bytes, allocating only when
        that grows it or pinning is newly needed."""
        assert not self.in_use, "the previous save still holds staged shards"
        size = min(self.capacity, aligned(wanted))
        if size <= 0:
            return
        pin = pinned and torch.cuda.is_available()
        if self._buffer is None or self._buffer.numel() < size or (pin and not self._buffer.is_pinned()):
            size = max(size, self.allocated)
            self._buffer = None  # the old buffer is freed before the new one is allocated
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)

    def reserve(self, size: int) -> int | None:
        """The offset of a free region of ``size`` bytes, or None when there is no room."""
        size = aligned(size)
        if size == 0 or self.in_use + size > self.allocated:
            return None
        offset, self.in_use = self.in_use, self.in_use + size
        return offset

    def view(self, offset: int, size: int) -> torch.Tensor:
        assert self._buffer is not None
        return self._buffer[offset:offset + size]

    def release_all(self) -> None:
        """The save's shards are on disk (or it failed): the whole buffer is free for the next one."""
        self.in_use = 0
