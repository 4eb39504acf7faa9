"""Training state that is not a module: loop counters and every random number generator.

RNG states are stored as tensors, ints and lists only, so a checkpoint loads with
``torch.load(weights_only=True)`` and never unpickles arbitrary objects.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class Stateful(Protocol):
    """Anything that can be checkpointed: modules, optimizers, schedulers, scalers, samplers."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclass
class TrainState:
    """Loop counters. ``batch_in_epoch`` is the index of the next batch to train in ``epoch``."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples_seen: int = 0
    elapsed_s: float = 0.0
    # Running sum of the training loss in the current epoch, so the epoch summary of a resumed run
    # equals that of an uninterrupted one.
    epoch_loss_sum: float = 0.0
    epoch_loss_count: int = 0
    best_test_acc: float | None = None
    best_step: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = {f.name for f in dataclasses.fields(self)}
        missing = names - set(state)
        if missing:
            raise ValueError(f"checkpoint train_state lacks {sorted(missing)}; it was written by an "
                             "incompatible version of resumable")
        for name in names:
            setattr(self, name, state[name])


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds all CUDA devices


def capture_rng() -> dict[str, Any]:
    """Every RNG stream the training loop can touch, as weights_only-loadable values."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch_cpu": torch.get_rng_state(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured. Raises if a CPU stream cannot be restored."""
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        nps = state["numpy"]
        np.random.set_state({
            "bit_generator": nps["bit_generator"],
            "state": {"key": nps["key"].numpy().astype(np.uint32), "pos": nps["pos"]},
            "has_gauss": nps["has_gauss"],
            "gauss": nps["gauss"],
        })
        torch.set_rng_state(state["torch_cpu"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"cannot restore the RNG state from the checkpoint ({e}); resuming would not be "
                         "exact. Start over with --fresh --overwrite or use another --run-dir") from e
    cuda_states = state.get("cuda", [])
    if not cuda_states:
        return
    if not torch.cuda.is_available():
        warnings.warn("the checkpoint holds CUDA RNG states but CUDA is not available: continuing on CPU, "
                      "so the run is no longer bit-identical to an uninterrupted GPU run", stacklevel=2)
        return
    count = torch.cuda.device_count()
    if count != len(cuda_states):
        warnings.warn(f"the checkpoint holds {len(cuda_states)} CUDA RNG states but {count} devices are "
                      "visible: restoring the common ones; bit-exactness is not guaranteed", stacklevel=2)
    for index, cuda_state in enumerate(cuda_states[:count]):
        torch.cuda.set_rng_state(cuda_state, device=index)
