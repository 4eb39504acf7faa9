"""Copy a whole training state into host memory, fast, so it can be written while training goes on.

Every tensor is copied — CPU ones too (the bug of pytorch#144657 was saving CPU tensors by reference,
so an optimizer step after ``save()`` returned changed the checkpoint). Buffers are allocated once and
reused, so later snapshots cost one memcpy and no page faults; on CUDA they are pinned and the
device-to-host copies are asynchronous, synchronised at the end on *every* device a tensor came from (a model
spread over several GPUs, e.g. ``device_map="auto"``, would otherwise be copied torn).

Buffers are keyed by the structural path of the tensor (a tuple of the real keys), so ``{0: a}`` and
``{"0": b}``, or a key containing ``/``, never share a buffer; containers keep their type and attributes
(``OrderedDict`` with the ``_metadata`` that ``Module.load_state_dict`` reads, named tuples).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

Path = tuple[Any, ...]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Snapshotter:
    """Reusable host buffers keyed by the tensor's path in the state tree.

    Only one snapshot may be in use at a time: the caller must finish writing the previous one before
    taking the next (the checkpoint writer waits for that).
    """

    def __init__(self, synchronize: Callable[[torch.device], None] = _synchronize) -> None:
        self._buffers: dict[Path, torch.Tensor] = {}
        self._synchronize = synchronize
        self.bytes = 0

    def take(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in this snapshotter's host buffers."""
        self.bytes = 0
        devices: set[torch.device] = set()
        copied = self._copy((), state, devices)
        for device in sorted(devices, key=str):
            self._synchronize(device)
        return copied

    def _buffer(self, key: Path, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if (buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype
                or buffer.stride() != tensor.stride()):
            # empty_like keeps the memory layout (e.g. channels_last): fused optimizers read their state
            # as raw memory laid out like the parameter, so a restored state must keep its strides.
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
            self._buffers[key] = buffer
        return buffer

    def _copy(self, key: Path, obj: Any, devices: set[torch.device]) -> Any:
        if isinstance(obj, torch.Tensor):
            source = obj.detach()
            buffer = self._buffer(key, source)
            asynchronous = source.device.type != "cpu"
            buffer.copy_(source, non_blocking=asynchronous)
            if asynchronous:
                devices.add(source.device)
            self.bytes += buffer.numel() * buffer.element_size()
            return buffer
        if isinstance(obj, dict):
            if type(obj) is dict:
                return {k: self._copy((*key, k), v, devices) for k, v in obj.items()}
            result = copy.copy(obj)  # OrderedDict keeps _metadata, defaultdict its factory
            for k, v in obj.items():
                result[k] = self._copy((*key, k), v, devices)
            return result
        if isinstance(obj, list):
            return [self._copy((*key, i), v, devices) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            items = [self._copy((*key, i), v, devices) for i, v in enumerate(obj)]
            return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
        return obj  # ints, floats, strings, None: immutable or rebuilt by state_dict() each time
