"""Host memory of a bounded size that a checkpoint's shards are copied into, so training goes on while they are
written (``--staging-memory``).

One save at a time uses it (the writer waits for the previous save before the next begins): the training thread
hands out regions one after the other while it stages shards, and the whole buffer is free again once that save
has written them. The buffer is allocated once, at the first save, no larger than the state needs, and reused
(later saves cost one memcpy and no page faults); it is page-locked when CUDA tensors are copied into it, so those
copies are asynchronous.

Page-locked by registering ordinary memory with CUDA (``cudaHostRegister``), not by ``pin_memory=True``: torch's
pinned allocator rounds every block up to a power of two, so a 4.2 GB state would lock 8.6 GB of a 12.7 GB Colab
VM; a registered buffer locks exactly its size, which the budget counts. Where registration fails the buffer stays
pageable (device copies into it are then synchronous): never more memory than the budget.
"""

from __future__ import annotations

import torch

from .. import log
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
        self._locked = False  # the buffer is registered with CUDA (page-locked)
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
        if self._buffer is None or self._buffer.numel() < size or (pin and not self._locked):
            size = max(size, self.allocated)
            self.free()  # the old buffer is freed before the new one is allocated
            self._buffer = torch.empty(size, dtype=torch.uint8)
            self._locked = pin and _lock(self._buffer)

    @property
    def locked(self) -> bool:
        """Whether the buffer is page-locked (device copies into it are asynchronous)."""
        return self._locked

    def free(self) -> None:
        """Give the buffer back (unregistered first when it was page-locked)."""
        if self._buffer is not None and self._locked:
            _unlock(self._buffer)
        self._buffer, self._locked = None, False

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone; the process frees it anyway
            pass

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


_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context (any device a rank uses)
_told: list[bool] = []


def _lock(buffer: torch.Tensor) -> bool:
    """Page-lock ``buffer`` in place, exactly its size (see the module docstring); False where CUDA refuses."""
    try:
        code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), _PORTABLE))
    except Exception as e:  # noqa: BLE001 - a CUDA runtime without the call: stay pageable
        code, why = -1, f"{type(e).__name__}: {e}"
    else:
        why = f"cudaError {code}"
    if code == 0:
        return True
    if not _told:
        _told.append(True)
        log.warning(f"could not page-lock the {buffer.numel() / 1e9:.1f} GB checkpoint staging buffer ({why}): "
                    f"copies from the GPU into it are synchronous (saves block training a little longer)")
    return False


def _unlock(buffer: torch.Tensor) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
    if code != 0:
        log.warning(f"unregistering the checkpoint staging buffer failed (cudaError {code})")
