"""resumable: PyTorch training that survives being killed at any instant and resumes bit-identically.

The public names are imported on first use (PEP 562), so ``resumable-train`` can install its signal handlers
before ``import torch`` takes its seconds: a SIGTERM or Ctrl-C during start-up is then a clean stop too.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {  # what training code calls; the engine's parts are imported from their modules
    "Checkpointing": "resumable.policies",
    "Evaluation": "resumable.policies",
    "IndexBatches": "resumable.engine.data.sources",
    "Loader": "resumable.policies",
    "Location": "resumable.policies",
    "PortableState": "resumable.engine.state.portable",
    "Reporting": "resumable.policies",
    "ResumableError": "resumable.errors",
    "ResumableSampler": "resumable.engine.data.sampler",
    "Run": "resumable.engine.run",
    "Session": "resumable.policies",
    "Stateful": "resumable.engine.state.train_state",
    "TrainState": "resumable.engine.state.train_state",
    "init_distributed": "resumable.distributed",
    "usable_device": "resumable.engine.state.preflight",
}
__all__ = sorted([*_PUBLIC, "__version__"])


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'resumable' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return __all__
