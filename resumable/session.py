"""Binds the stateful objects of a run to its checkpoints: what goes into one, and how it comes back."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .checkpoint import CheckpointInfo, CheckpointManager, InvalidCheckpoint, fingerprint
from .state import Stateful, TrainState, capture_rng, restore_rng

# Payload keys that are not user objects.
_TRAIN_STATE, _RNG = "train_state", "rng"


class Session:
    """Saves and restores ``objects`` (name → Stateful), the TrainState and every RNG stream.

    ``meta`` is recorded in each manifest (config, dataset identity, computation fields) and is what a
    later start compares against before resuming.
    """

    def __init__(self, manager: CheckpointManager, objects: Mapping[str, Stateful | None],
                 state: TrainState, meta: dict[str, Any], keep: int = 3, keep_best: bool = True,
                 before_commit: Callable[[], None] | None = None) -> None:
        if "model" not in objects or "optimizer" not in objects:
            raise ValueError("a session needs at least 'model' and 'optimizer' objects")
        self.manager = manager
        self.objects = dict(objects)
        self.state = state
        self.meta = meta
        self.keep = keep
        self.keep_best = keep_best
        self.before_commit = before_commit
        self.last_saved_step: int | None = None
        self.resumed_from: CheckpointInfo | None = None

    def payload(self) -> dict[str, Any]:
        """Everything an exact resume needs, as plain containers and tensors."""
        payload: dict[str, Any] = {name: (obj.state_dict() if obj is not None else None)
                                   for name, obj in self.objects.items()}
        payload[_TRAIN_STATE] = self.state.state_dict()
        payload[_RNG] = capture_rng()
        return payload

    def save(self, reason: str, metrics: dict[str, float] | None = None) -> CheckpointInfo:
        """Commit a checkpoint of the current state, then prune old ones."""
        payload = self.payload()
        if self.before_commit is not None:
            self.before_commit()
        meta = {
            **self.meta,
            "epoch": self.state.epoch,
            "batch_in_epoch": self.state.batch_in_epoch,
            "reason": reason,
            "metrics": metrics or {},
            "num_threads": torch.get_num_threads(),
            "fingerprint": fingerprint(payload["model"], payload["optimizer"]),
        }
        info = self.manager.save(self.state.step, payload, meta)
        self.last_saved_step = self.state.step
        self.manager.prune(self.keep, self.keep_best)
        return info

    def restore(self, info: CheckpointInfo) -> None:
        """Load ``info`` into every object. Raises InvalidCheckpoint before touching anything if the
        payload is unreadable, incomplete or does not match its manifest's fingerprint."""
        payload = self.manager.load(info)
        expected = set(self.objects) | {_TRAIN_STATE, _RNG}
        missing = sorted(expected - set(payload))
        if missing:
            raise InvalidCheckpoint(f"payload lacks {missing}")
        if fingerprint(payload["model"], payload["optimizer"]) != info.fingerprint:
            raise InvalidCheckpoint("payload does not match the manifest's training-state fingerprint")
        for name, obj in self.objects.items():
            if obj is None:
                continue
            if payload[name] is None:
                raise InvalidCheckpoint(f"checkpoint has no {name} state but this run uses one")
            obj.load_state_dict(payload[name])
        self.state.load_state_dict(payload[_TRAIN_STATE])
        restore_rng(payload[_RNG])  # last: loading must not consume random numbers after it
        self.last_saved_step = info.step
        self.resumed_from = info
