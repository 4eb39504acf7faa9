"""The global switches that change what a computation returns, recorded with every checkpoint.

Bit-identity of a resumed run is only promised when these match the checkpoint's: cuDNN autotuning
(``benchmark``) and non-deterministic kernels pick different algorithms per process, TF32 rounds matmuls
differently, and cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` for deterministic results. A resume that finds a
difference says which one, and goes on (the user may have changed it on purpose).
"""

from __future__ import annotations

import os
from typing import Any

import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
# Deterministic cuBLAS for a few MB of workspace (PyTorch's reproducibility notes); set only when unset and
# only before CUDA starts, which is when it takes effect.
CUBLAS_DETERMINISTIC = ":4096:8"


def settings() -> dict[str, Any]:
    return {
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
        "cuda_matmul_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cublas_workspace_config": os.environ.get(CUBLAS_ENV),
    }


def differences(saved: Any, current: dict[str, Any]) -> list[str]:
    """Human-readable differences between a checkpoint's settings and now (none for older checkpoints)."""
    if not isinstance(saved, dict):
        return []
    return [f"{name}: checkpoint {saved[name]!r}, now {current.get(name)!r}"
            for name in sorted(saved) if name in current and saved[name] != current[name]]


def _major_minor(version: Any) -> tuple[int, ...] | None:
    """``"2.14.1+cu130"`` → ``(2, 14)``; None for anything that is not such a version."""
    parts = str(version).split("+")[0].split(".")[:2]
    return tuple(int(p) for p in parts) if len(parts) == 2 and all(p.isdigit() for p in parts) else None


def version_difference(saved: Any, current: str = torch.__version__) -> str | None:
    """A warning when the checkpoint was written by another torch major.minor (None: the same, or unknown).
    Such a checkpoint resumes, but kernels and RNG implementations may change between releases."""
    before, now = _major_minor(saved), _major_minor(current)
    if before is None or now is None or before == now:
        return None
    return (f"this checkpoint was written with torch {saved} and this session runs torch {current}: it resumes, "
            f"but bit-identity with an uninterrupted run is only promised on the same torch version")


def set_cheap_defaults() -> list[str]:
    """Set the deterministic defaults that cost little; returns what was set (for the log)."""
    changed = []
    if os.environ.get(CUBLAS_ENV) is None and not torch.cuda.is_initialized():
        os.environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC
        changed.append(f"{CUBLAS_ENV}={CUBLAS_DETERMINISTIC}")
    return changed
