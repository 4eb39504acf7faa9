"""Copy a whole training state into host memory, fast, so it can be written while training goes on.

Every tensor is copied — CPU ones too (the bug of pytorch#144657 was saving CPU tensors by reference,
so an optimizer step after ``save()`` returned changed the checkpoint). Buffers are allocated once and
reused, so later snapshots cost one memcpy and no page faults; on CUDA they are pinned and the
device-to-host copies are asynchronous, synchronised once at the end.
"""

from __future__ import annotations

from typing import Any

import torch


class Snapshotter:
    """Reusable host buffers keyed by the tensor's path in the state tree.

    Only one snapshot may be in use at a time: the caller must finish writing the previous one before
    taking the next (the checkpoint writer waits for that).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.bytes = 0

    def take(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this snapshotter's host buffers."""
        self.bytes = 0
        used_cuda = [False]
        copy = self._copy("", state, used_cuda)
        if used_cuda[0]:
            torch.cuda.synchronize()
        return copy

    def _buffer(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if (buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype
                or buffer.stride() != tensor.stride()):
            # empty_like keeps the memory layout (e.g. channels_last): fused optimizers read their state
            # as raw memory laid out like the parameter, so a restored state must keep its strides.
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
            self._buffers[key] = buffer
        return buffer

    def _copy(self, key: str, obj: Any, used_cuda: list[bool]) -> Any:
        if isinstance(obj, torch.Tensor):
            source = obj.detach()
            buffer = self._buffer(key, source)
            buffer.copy_(source, non_blocking=source.is_cuda)
            used_cuda[0] |= source.is_cuda
            self.bytes += buffer.numel() * buffer.element_size()
            return buffer
        if isinstance(obj, dict):
            return {k: self._copy(f"{key}/{k}", v, used_cuda) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._copy(f"{key}/{i}", v, used_cuda) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._copy(f"{key}/{i}", v, used_cuda) for i, v in enumerate(obj))
        return obj  # ints, floats, strings, None: immutable or rebuilt by state_dict() each time
