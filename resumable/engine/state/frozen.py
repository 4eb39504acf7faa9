"""The model's frozen tensors: recorded in each manifest by a fingerprint instead of being written.

A LoRA fine-tune trains a few MB beside a frozen base of 1-14 GB; storing that base in every checkpoint fills a
15 GB Drive after one or two of them. A tensor of the model is *frozen* when it does not require grad, no
optimizer owns it, and it has not changed since the run started (or resumed). For a parameter, torch counts
every in-place change (``_version``, shared by ``detach()``) and a re-assigned one has another address, so both
are noticed at the next save, which then stores it. Buffers are compared by their bytes at every save instead:
batch norm updates its running statistics without counting the change, and buffers are small.

The script builds the frozen tensors itself on every start (it loads the base weights), so a resume checks them
against the checkpoint's fingerprints (sha256 of their bytes) before anything is loaded: a different base is a
one-line error naming the tensor. Which parameters require grad is state, restored at a resume like the modules'
train/eval modes (a backbone unfrozen at epoch 1 trains again after a resume in epoch 2); a LoRA re-wrapped
differently has other state_dict keys, which the resume refuses anyway.

One change torch does not count: writing through ``tensor.data`` (``p.data.mul_(0.9)``). A script that updates
a frozen tensor that way must use ``torch.no_grad()`` and in-place ops on the tensor itself, or pass
``Checkpointing(store_frozen=True)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from ... import log
from ...checkpoint.digests import tensor_digest
from ...errors import ResumableError

Signature = tuple[int, int, tuple[int, ...], torch.dtype, str]


class FrozenMismatch(ResumableError):
    """The script built frozen tensors other than the ones the checkpoint was trained with (exit 2)."""


def _signature(tensor: torch.Tensor) -> Signature:
    return tensor.data_ptr(), tensor._version, tuple(tensor.shape), tensor.dtype, str(tensor.device)


def record_of(tensor: torch.Tensor) -> dict[str, Any]:
    return {"sha256": tensor_digest(tensor), "shape": list(tensor.shape), "dtype": str(tensor.dtype)}


class FrozenTensors:
    """Which tensors of ``model``'s state_dict are left out of checkpoints (none with ``store_all``)."""

    def __init__(self, model: Any, optimizers: Iterable[Any], store_all: bool = False) -> None:
        self.model = model if isinstance(model, torch.nn.Module) else None
        self.store_all = store_all
        self._owned = {id(p) for opt in optimizers for group in getattr(opt, "param_groups", ())
                       for p in group.get("params", ())}
        self._baseline: dict[str, Signature] = {}
        self._buffers: dict[str, str] = {}  # buffer name -> sha256 when armed
        self._pinned: set[str] = set()  # loaded from a checkpoint with a value the script does not build: stored
        self._records: dict[str, tuple[Signature, dict[str, Any]]] = {}  # fingerprints, by the signature hashed
        self._announced = False
        self.arm()

    def _candidates(self) -> dict[str, torch.Tensor]:
        """The tensors that may be frozen: parameters without grad that no optimizer owns, and buffers."""
        if self.model is None:
            return {}
        found = {name: p for name, p in self.model.named_parameters(remove_duplicate=False)
                 if not p.requires_grad and id(p) not in self._owned}
        found.update(self._named_buffers())
        return {name: t for name, t in found.items() if t.device.type != "meta"}

    def _named_buffers(self) -> dict[str, torch.Tensor]:
        assert self.model is not None
        return {name: b for name, b in self.model.named_buffers(remove_duplicate=False) if b is not None}

    def arm(self) -> None:
        """Take the tensors as they are now as the unchanged state (at start, and again after a restore)."""
        if self.model is None or self.store_all:
            return
        self._baseline = {name: _signature(t) for name, t in self._candidates().items()}
        self._buffers = {name: self._record(name, b, fresh=True)["sha256"] for name, b in self._named_buffers().items()
                         if b.device.type != "meta"}

    def built(self, names: Iterable[str]) -> dict[str, str]:
        """Before a restore overwrites the candidates ``names``: the sha256 of what the script built for them."""
        live = self._candidates()
        return {name: self._record(name, live[name], fresh=True)["sha256"] for name in names if name in live}

    def loaded(self, built: dict[str, str]) -> None:
        """After a restore: a tensor loaded with a value other than the script's stays stored in every later
        checkpoint (a fresh start would build the script's value, not this one); the rest is armed anew."""
        live = self._candidates()
        for name, digest in built.items():
            if name in live and self._record(name, live[name], fresh=True)["sha256"] != digest:
                self._pinned.add(name)
        self.arm()

    def _unchanged(self, name: str, tensor: torch.Tensor) -> bool:
        if name in self._pinned:
            return False
        if name in self._buffers:
            return self._record(name, tensor, fresh=True)["sha256"] == self._buffers[name]
        return self._baseline.get(name) == _signature(tensor)

    def trainable(self) -> list[str]:
        if self.model is None:
            return []
        return [name for name, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad]

    def _record(self, name: str, tensor: torch.Tensor, fresh: bool = False) -> dict[str, Any]:
        """The fingerprint record of ``tensor``; hashed again unless it is unchanged by its signature (``fresh``:
        always, for buffers, whose changes torch may not count)."""
        signature = _signature(tensor)
        cached = self._records.get(name)
        if fresh or cached is None or cached[0] != signature:
            cached = (signature, record_of(tensor))
            self._records[name] = cached
        return cached[1]

    def split(self, model_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """``model_state`` without the frozen tensors, and their manifest record (name -> sha256, shape, dtype).

        The first call fingerprints them (hashing the whole frozen base once, on the training thread)."""
        if self.store_all or self.model is None or not isinstance(model_state, dict):
            return model_state, {}
        started = time.perf_counter()
        frozen: dict[str, dict[str, Any]] = {}
        live = self._candidates()
        for name, tensor in live.items():
            stored = model_state.get(name)
            if not isinstance(stored, torch.Tensor) or stored.data_ptr() != tensor.data_ptr():
                continue  # not in the state_dict (non-persistent), or the module stores something else for it
            if not self._unchanged(name, tensor):
                continue  # changed since start: stored like any trained tensor
            frozen[name] = self._record(name, tensor)
        if not frozen:
            return model_state, {}
        kept = type(model_state)() if type(model_state) is not dict else {}
        if hasattr(model_state, "_metadata"):
            kept._metadata = model_state._metadata  # type: ignore[attr-defined]
        for key, value in model_state.items():
            if key not in frozen:
                kept[key] = value
        if not self._announced:
            self._announced = True
            size = sum(live[n].numel() * live[n].element_size() for n in frozen)
            log.info(f"not storing {len(frozen)} frozen tensor(s) of the model ({size / 1e6:.1f} MB; fingerprinted in "
                     f"{time.perf_counter() - started:.2f}s): a resume checks that your script builds them "
                     f"identically. Pass Checkpointing(store_frozen=True) (--store-frozen) to store them too")
        return kept, frozen

    def check(self, saved: dict[str, Any] | None, step: int) -> None:
        """Raise FrozenMismatch unless this model holds every tensor the checkpoint left out, bit for bit."""
        if not saved:
            return
        live = dict(self.model.state_dict(keep_vars=True)) if self.model is not None else {}
        buffers = set(self._named_buffers()) if self.model is not None else set()
        for name in sorted(saved):
            expected = saved[name]
            tensor = live.get(name)
            if not isinstance(tensor, torch.Tensor):
                raise FrozenMismatch(f"the checkpoint of step {step} did not store the frozen tensor {name!r} (your "
                                     f"script provides it) but this model has no {name!r}: build the same model as "
                                     f"the run did; nothing was changed")
            if [*tensor.shape] != expected["shape"] or str(tensor.dtype) != expected["dtype"]:
                raise FrozenMismatch(f"the frozen tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype} here but "
                                     f"{tuple(expected['shape'])} {expected['dtype']} in the checkpoint of step "
                                     f"{step}: load the same base model as the run did; nothing was changed")
            if self._record(name, tensor.detach(), fresh=name in buffers)["sha256"] != expected["sha256"]:
                raise FrozenMismatch(f"the frozen tensor {name!r} differs from the one the checkpoint of step {step} "
                                     f"was trained with (sha256 {expected['sha256'][:12]}...): your script loaded "
                                     f"other base weights. Load the same ones (or start over with --fresh "
                                     f"--overwrite); nothing was changed")

    def saved_trainable(self, saved: Any) -> list[str] | None:
        """The checkpoint's trainable parameter names, validated (a malformed record is a corrupt checkpoint)."""
        if saved is None or self.model is None:
            return None
        if not isinstance(saved, list) or not all(isinstance(name, str) for name in saved):
            from ...checkpoint import InvalidCheckpoint

            raise InvalidCheckpoint("its manifest's 'trainable' is not a list of parameter names")
        return saved

    def trainable_difference(self, saved: list[str] | None) -> str | None:
        """How the parameters that require grad now differ from ``saved`` (None: the same, or unknown)."""
        if saved is None or self.model is None:
            return None
        now = self.trainable()
        return _flags_change(sorted(set(now) - set(saved)), sorted(set(saved) - set(now)), "now ") or None

    def restore_trainable(self, saved: list[str] | None, step: int) -> None:
        """Set every parameter's ``requires_grad`` as it was when the checkpoint was written: which parameters train
        is state, like a module's train/eval mode (a backbone unfrozen at epoch 1 is trainable again after a
        resume in a later epoch). Only a tensor recorded as frozen must be unchanged (:meth:`check`)."""
        if saved is None or self.model is None:
            return
        wanted = set(saved)
        changed = [name for name, p in self.model.named_parameters(remove_duplicate=False)
                   if p.requires_grad != (name in wanted)]
        if not changed:
            return
        for name, parameter in self.model.named_parameters(remove_duplicate=False):
            parameter.requires_grad_(name in wanted)
        change = _flags_change([n for n in changed if n in wanted], [n for n in changed if n not in wanted])
        log.info(f"requires_grad set as at step {step} ({change}): which parameters train is part of the checkpoint")


def _flags_change(gained: list[str], lost: list[str], prefix: str = "") -> str:
    """``trainable: a, b; frozen: c`` (three names of each at most), for the messages about requires_grad."""
    parts = []
    for label, found in (("trainable", gained), ("frozen", lost)):
        if found:
            parts.append(f"{prefix}{label}: {', '.join(found[:3])}{' ...' if len(found) > 3 else ''}")
    return "; ".join(parts)
