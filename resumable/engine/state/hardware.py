"""The device a session trains on, as each checkpoint records it, and the AMP choice that follows from it.

Colab hands out a T4 one session, an L4 or A100 the next, and no GPU at all once the quota is spent. Every
checkpoint records where it was written (``device_type``, ``gpu_name``, ``gpu_capability``, ``cuda_version``,
``amp_dtype``; ``torch_version`` is recorded by the manager), so a resume on another device can say so in one
line: the run continues, but bit-identity is only promised on the same device.

``--amp auto`` (:func:`choose_amp`) picks bf16 where the GPU computes it natively (compute capability 8.0 and
later: A100, L4, H100), fp16 with a GradScaler on older GPUs (T4, V100), and no autocast on the CPU: bf16
autocast does run on a CPU, but without AMX/AVX512-BF16 (most Colab CPUs) it is slower than float32, and a
CPU session is the fallback when the GPU quota is spent, not where precision should change. On resume
(:func:`resume_amp`) the checkpoint's choice is kept while it can run here: the only switch is bf16 → fp16
on a GPU without native bf16, where bf16 runs emulated (several times slower) and fp16 needs a fresh
GradScaler.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

AMP_DTYPES = ("none", "bf16", "fp16")
NATIVE_BF16_CAPABILITY = (8, 0)  # Ampere: bf16 tensor cores (A100 sm_80, A10/L4 sm_86/89, H100 sm_90)


def choose_amp(device_type: str, capability: tuple[int, int] | None, bf16_native: bool | None) -> str:
    """The AMP mode ``--amp auto`` picks for a fresh run: ``bf16`` where the GPU has it natively, else ``fp16``
    (with a GradScaler) on CUDA, else ``none``. ``bf16_native`` None (unknown): judged from the capability.

    >>> choose_amp("cuda", (7, 5), False), choose_amp("cuda", (8, 9), True), choose_amp("cpu", None, None)
    ('fp16', 'bf16', 'none')
    """
    if device_type != "cuda":
        return "none"  # see the module docstring: CPU bf16 autocast is real but usually slower than float32
    return "bf16" if _native(capability, bf16_native) else "fp16"


def resume_amp(saved: str, device_type: str, capability: tuple[int, int] | None,
               bf16_native: bool | None) -> tuple[str, str | None]:
    """The AMP mode ``--amp auto`` continues a checkpoint of AMP mode ``saved`` with here, and why it switched
    (None: it kept the checkpoint's). Only bf16 on a CUDA GPU without native bf16 switches, to fp16: switching
    back to bf16 on a later A100 would change the numerics a second time for a speed-up, so an fp16 run stays
    fp16, and a none run stays none."""
    if saved == "bf16" and device_type == "cuda" and not _native(capability, bf16_native):
        return "fp16", "has no native bf16 (compute capability 8.0 or later): bf16 would run emulated, slowly"
    return saved, None


def _native(capability: tuple[int, int] | None, bf16_native: bool | None) -> bool:
    if bf16_native is not None:
        return bf16_native
    return capability is not None and tuple(capability) >= NATIVE_BF16_CAPABILITY


def probe(device: torch.device | str) -> tuple[tuple[int, int] | None, bool | None]:
    """``(compute capability, native bf16)`` of ``device``; ``(None, None)`` for a device that is not CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, None
    capability = tuple(torch.cuda.get_device_capability(device))
    check = torch.cuda.is_bf16_supported
    try:  # including_emulation (torch 2.3+) defaults to True: T4 would count as bf16-capable
        native = (check(including_emulation=False) if "including_emulation" in inspect.signature(check).parameters
                  else check())
    except (RuntimeError, TypeError, ValueError):
        native = None
    return (capability[0], capability[1]), native


def describe(device: torch.device | str) -> dict[str, Any]:
    """What a checkpoint records about the device it was written on (manifest fields, all optional)."""
    device = torch.device(device)
    record: dict[str, Any] = {"device_type": device.type}
    if device.type == "cuda" and torch.cuda.is_available():
        capability, _ = probe(device)
        record["gpu_name"] = torch.cuda.get_device_name(device)
        record["gpu_capability"] = list(capability) if capability is not None else None
    if device.type == "cpu":  # CPU kernels round differently per instruction set (AVX2, AVX512...)
        record["cpu_capability"] = cpu_capability()
    if torch.version.cuda is not None:
        record["cuda_version"] = torch.version.cuda
    return {k: v for k, v in record.items() if v is not None}


def cpu_capability() -> str | None:
    """The instruction set torch's CPU kernels use here (``AVX512``, ``AVX2``...): float results may differ between
    two, so it is part of "the same device"."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - an old torch without it
        return None


def _identity(record: dict[str, Any]) -> tuple[str, str | None, tuple[int, ...] | None] | None:
    """(type, GPU name, capability) of a manifest or meta; older checkpoints have only ``device`` ("cuda:0")."""
    kind = record.get("device_type")
    if not isinstance(kind, str):
        device = record.get("device")
        if not isinstance(device, str) or not device:
            return None
        kind = device.split(":")[0]
    name = record.get("gpu_name") if isinstance(record.get("gpu_name"), str) else None
    capability = record.get("gpu_capability")
    return kind, name, tuple(capability) if isinstance(capability, list) else None


def label(record: dict[str, Any]) -> str:
    """``cuda (Tesla T4, sm_75)``, ``cuda`` (an older checkpoint) or ``cpu``."""
    identity = _identity(record)
    if identity is None:
        return "an unknown device"
    kind, name, capability = identity
    details = [d for d in (name, f"sm_{capability[0]}{capability[1]}" if capability and len(capability) == 2
                           else None) if d]
    return f"{kind} ({', '.join(details)})" if details else kind


def cross_device_line(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The one line a resume on another device logs (None: the same device, or the checkpoint does not say).
    A GPU name or capability the checkpoint lacks (written before they were recorded) is not a difference."""
    before, now = _identity(saved), _identity(current)
    if before is None or now is None:
        return None
    cpus = saved.get("cpu_capability"), current.get("cpu_capability")
    if before[0] == now[0] == "cpu" and all(isinstance(c, str) for c in cpus) and cpus[0] != cpus[1]:
        return (f"checkpoint written on a CPU whose kernels use {cpus[0]}, resuming on one that uses {cpus[1]}: the "
                f"run continues, but bit-identity with an uninterrupted run is only promised on the same kind of CPU")
    differs = before[0] != now[0] or any(a is not None and b is not None and a != b
                                         for a, b in zip(before[1:], now[1:], strict=True))
    if not differs:
        return None
    return (f"checkpoint written on {label(saved)}, resuming on {label(current)}: the run continues, but "
            f"bit-identity with an uninterrupted run is only promised on the same device")


def device_of(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters are (the CPU for a model without any): the device ``Run`` trains on by default."""
    parameter = next(iter(model.parameters()), None)
    return parameter.device if parameter is not None else torch.device("cpu")
