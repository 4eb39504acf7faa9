"""Training state that is not a module: loop counters and every random number generator.

RNG states are stored as tensors, ints and lists only, so a checkpoint loads with
``torch.load(weights_only=True)`` and never unpickles arbitrary objects.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ... import log
from ..data import content_check

# A payload's per-rank entries: RANKS holds one entry per rank (its RNG streams, counters and DATA_NEXT, the record of
# its next batch); checkpoints before per-rank counters hold OLD_RNG_RANKS (every rank's RNG only), or RNG alone.
RNG, RANKS, OLD_RNG_RANKS, DATA_NEXT = "rng", "ranks", "rng_ranks", "data_next"


@runtime_checkable
class Stateful(Protocol):
    """Anything that can be checkpointed: modules, optimizers, schedulers, scalers, samplers."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def _per_rank(default: Any) -> Any:
    """A counter each DDP rank keeps for itself (saved per rank, restored on the matching rank)."""
    return field(default=default, metadata={"per_rank": True})


@dataclass
class TrainState:
    """Loop counters. ``batch_in_epoch`` is the index of the next batch to train in ``epoch``.

    Fields are *replicated* (equal on every DDP rank, saved once) unless marked per-rank: those are saved
    for every rank and each rank gets its own back, so e.g. the epoch's train loss over all ranks' batches
    is the same in a resumed run as in an uninterrupted one."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples_seen: int = _per_rank(0)  # this rank's samples
    elapsed_s: float = 0.0
    # Running sum of this rank's training loss in the current epoch, so the epoch summary of a resumed run
    # equals that of an uninterrupted one.
    epoch_loss_sum: float = _per_rank(0.0)
    epoch_loss_count: int = _per_rank(0)
    # The best evaluation so far: its monitored value and step, and which metric that is ("val_loss:min"), so that a
    # resume monitoring another one starts its best afresh (engine/loop/evaluation.py).
    best_value: float | None = None
    best_step: int | None = None
    best_metric: str | None = None

    @classmethod
    def per_rank_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("per_rank"))

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def rank_dict(self) -> dict[str, Any]:
        """This rank's own counters (see :meth:`per_rank_fields`)."""
        return {name: getattr(self, name) for name in self.per_rank_fields()}

    def load_rank_dict(self, counters: dict[str, Any]) -> None:
        for name in self.per_rank_fields():
            setattr(self, name, counters[name])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "best_test_acc" in state and "best_value" not in state:  # before any metric could be monitored
            acc = state["best_test_acc"]
            state = {**state, "best_value": acc, "best_metric": "test_acc:max" if acc is not None else None}
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
        # A GPU checkpoint resumed on the CPU: there is no CUDA generator to restore them into. The resume says
        # once, in its cross-device line (engine/state/hardware.py), that bit-identity is only promised on one device.
        log.info(f"skipping the checkpoint's {len(cuda_states)} CUDA RNG state(s): CUDA is not available here")
        return
    count = torch.cuda.device_count()
    if count != len(cuda_states):
        warnings.warn(f"the checkpoint holds {len(cuda_states)} CUDA RNG states but {count} devices are "
                      "visible: restoring the common ones; bit-exactness is not guaranteed", stacklevel=2)
    for index, cuda_state in enumerate(cuda_states[:count]):
        torch.cuda.set_rng_state(cuda_state, device=index)


class TorchGeneratorState:
    """A user's ``torch.Generator`` as a Stateful."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"torch_generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["torch_generator"])


class NumpyGeneratorState:
    """A user's ``numpy.random.Generator`` (or bare BitGenerator) as a Stateful: its bit generator's state,
    plain ints and strings."""

    def __init__(self, generator: Any) -> None:
        self.bit_generator = getattr(generator, "bit_generator", generator)

    def state_dict(self) -> dict[str, Any]:
        return {"numpy_bit_generator": self.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bit_generator.state = state["numpy_bit_generator"]


class PythonRandomState:
    """A user's ``random.Random`` as a Stateful (the state tuple as lists and ints)."""

    def __init__(self, generator: random.Random) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.generator.getstate()
        return {"python_random": {"version": version, "state": list(internal), "gauss": gauss}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["python_random"]
        self.generator.setstate((saved["version"], tuple(saved["state"]), saved["gauss"]))


def as_stateful(name: str, obj: Any) -> Stateful:
    """``obj`` as something with ``state_dict``/``load_state_dict``: random generators are wrapped, anything
    else that lacks the protocol is refused now rather than at the first save."""
    if isinstance(obj, torch.Generator):
        return TorchGeneratorState(obj)
    if isinstance(obj, (np.random.Generator, np.random.BitGenerator)):
        return NumpyGeneratorState(obj)
    if isinstance(obj, random.Random):
        return PythonRandomState(obj)
    if isinstance(obj, Stateful):
        return obj
    raise TypeError(f"objects[{name!r}] is a {type(obj).__name__}, which has no state_dict()/load_state_dict(); "
                    f"pass something Stateful (or a torch/numpy/random generator, which resumable wraps)")


def plain_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose state dict is checkpointed: inside ``torch.compile`` (``_orig_mod``) and
    ``DistributedDataParallel`` (``module``) wrappers, so keys carry no prefix and a checkpoint loads into the
    plain model, with or without those wrappers, on any number of GPUs."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def rank_state(payload: dict[str, Any], rank: int, world: int
               ) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any] | None]:
    """This rank's (RNG states, per-rank counters, record of its next batch) from ``payload``.

    When the world size changed, rank 0 takes every saved rank's counters summed (so the epoch's loss
    over all ranks stays right) and the other ranks start theirs from zero; RNG streams are rank 0's, and no
    rank's next batch is known (the batches are split differently)."""
    ranks = payload.get(RANKS)
    if isinstance(ranks, list) and ranks:
        if len(ranks) == world:
            mine = ranks[rank]
            record = mine.get(DATA_NEXT)  # absent in checkpoints before the content check
            return mine["rng"], mine["counters"], (record if content_check.valid_record(record) else None)
        counters = {name: (sum(r["counters"][name] for r in ranks) if rank == 0 else 0 * ranks[0]["counters"][name])
                    for name in TrainState.per_rank_fields()}
        return ranks[0]["rng"], counters, None
    old = payload.get(OLD_RNG_RANKS)
    if isinstance(old, list) and len(old) == world:
        return old[rank], None, None
    return payload[RNG], None, None
