"""Before a checkpoint is loaded on a GPU: one real CUDA operation, and the GPU's architecture against the ones this
torch was built for. A GPU can say it is there and still be unusable: on a Kaggle P100, ``torch.cuda.is_available()``
is True but the image's torch dropped sm_60, so the first kernel fails ("no kernel image is available for execution on
the device") after the session has started. Checked first, the failure is one message naming what happened and the
fix (exit 2), or, where the user allowed it, a warning and the CPU.

``resumable-train --cpu-fallback`` and :func:`usable_device` (``allow_cpu=True``) fall back to the CPU; a
:class:`resumable.Run` whose model is already on the GPU gets the error before anything is loaded.
"""

from __future__ import annotations

import torch

from ... import log, platforms
from ...errors import EXIT_USAGE, ResumableError


class DeviceUnusable(ResumableError):
    """The GPU failed its preflight; the message says what happened and the fix."""

    exit_code = EXIT_USAGE


def _arch(name: str) -> tuple[str, int] | None:
    """``"sm_86"`` -> ``("sm", 86)``, ``"compute_90"`` -> ``("compute", 90)``; None for anything else."""
    kind, _, number = name.partition("_")
    digits = "".join(ch for ch in number if ch.isdigit())
    return (kind, int(digits)) if kind in ("sm", "compute") and digits else None


def runs_on(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether code built for ``arch_list`` (``torch.cuda.get_arch_list()``) runs on a GPU of ``capability``: a
    binary for the same major and a minor not above the GPU's, or PTX (``compute_XY``) not above it to JIT from.
    An empty list (unknown) passes: the CUDA operation decides.

    >>> runs_on((6, 0), ["sm_70", "sm_75", "sm_80"]), runs_on((8, 6), ["sm_80"]), runs_on((9, 0), ["compute_80"])
    (False, True, True)
    """
    if not arch_list:
        return True
    major, minor = capability
    here = major * 10 + minor
    for entry in filter(None, map(_arch, arch_list)):
        kind, number = entry
        if kind == "sm" and number // 10 == major and number % 10 <= minor:
            return True
        if kind == "compute" and number <= here:
            return True
    return False


def cuda_problem(device: torch.device) -> str | None:
    """Why ``device`` (CUDA) cannot train here, or None when its architecture is supported and a real operation on it
    gives the right answer."""
    where = f"CUDA device {device.index or 0}"
    try:
        name = torch.cuda.get_device_name(device)
        capability = tuple(torch.cuda.get_device_capability(device))
        where = f"{where} ({name}, sm_{capability[0]}{capability[1]})"
        built = list(torch.cuda.get_arch_list())
        if not runs_on((capability[0], capability[1]), built):
            return (f"{where} is not among the GPU architectures this torch {torch.__version__} was built for "
                    f"({', '.join(built)})")
        x = torch.arange(8, dtype=torch.float32, device=device)
        got = float((x * 2).sum().item())
    except Exception as e:  # noqa: BLE001 - whatever the driver or runtime raises is the answer
        return f"{where} failed its first CUDA operation: {type(e).__name__}: {str(e).strip().splitlines()[0]}"
    if got != 56.0:
        return f"{where} computed 2 * (0 + 1 + ... + 7) = {got}, not 56.0"
    return None


def _fix(option: str) -> str:
    kaggle = " In Kaggle: Settings > Accelerator > GPU T4 x2 (the P100 is not supported by this image's torch)."
    return (f"Train on a GPU this torch supports, install a torch built for this one, or train on the CPU ({option})."
            + (kaggle if platforms.in_kaggle() else ""))


def check_cuda(device: torch.device, option: str = "device='cpu', with the model built on the CPU") -> None:
    """DeviceUnusable (exit 2) naming the problem and the fix when ``device`` is CUDA and fails :func:`cuda_problem`."""
    if device.type != "cuda":
        return
    problem = cuda_problem(device)
    if problem is not None:
        raise DeviceUnusable(f"{problem}. Nothing was loaded or trained. {_fix(option)}")


def usable_device(prefer: str = "cuda", allow_cpu: bool = False, index: int = 0,
                  hint: str = "allow_cpu=True to fall back to it") -> torch.device:
    """The device to build a model on: ``prefer`` (``"cuda"``) when it is there and passes the preflight, else the
    CPU: with a warning when CUDA is there but fails and ``allow_cpu``, DeviceUnusable (exit 2) when it fails and the
    CPU was not allowed (``hint``: how to allow it, in the fix). ``prefer="cpu"`` is the CPU."""
    if prefer == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", index)
    problem = cuda_problem(device)
    if problem is None:
        return device
    if not allow_cpu:
        raise DeviceUnusable(f"{problem}. {_fix(hint)}")
    log.warning(f"{problem}: training on the CPU instead (allowed); it is much slower")
    return torch.device("cpu")
