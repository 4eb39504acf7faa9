"""Binds the stateful objects of a run to its checkpoints: what goes into one, and how it comes back."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..checkpoint import CheckpointInfo, CheckpointManager, InvalidCheckpoint, fingerprint
from ..checkpoint.snapshot import Snapshotter
from ..checkpoint.writer import CheckpointWriter
from .distributed import Distributed
from .state import Stateful, TrainState, capture_rng, restore_rng

# Payload keys that are not user objects; RNG_RANKS holds every rank's RNG states under DDP.
_TRAIN_STATE, _RNG, RNG_RANKS = "train_state", "rng", "rng_ranks"


class Session:
    """Saves and restores ``objects`` (name → Stateful), the TrainState and every RNG stream.

    ``meta`` is recorded in each manifest (config, dataset identity, computation fields) and is what a
    later start compares against before resuming. With an asynchronous ``writer``, ``save`` copies the
    state into host memory and returns; serialising, hashing, fsync, commit and pruning happen on the
    writer's thread. ``before_commit`` runs on the writer's thread just before the checkpoint is written
    (e.g. to make logs durable up to this step), ``after_commit(step)`` after it is committed and pruned
    (e.g. to mirror it to Drive).
    """

    def __init__(self, manager: CheckpointManager, objects: Mapping[str, Stateful | None],
                 state: TrainState, meta: dict[str, Any], keep: int = 3, keep_best: bool = True,
                 writer: CheckpointWriter | None = None,
                 before_commit: Callable[[], None] | None = None,
                 after_commit: Callable[[int], None] | None = None, dist: Distributed | None = None) -> None:
        if "model" not in objects or "optimizer" not in objects:
            raise ValueError("a session needs at least 'model' and 'optimizer' objects")
        self.manager = manager
        self.objects = dict(objects)
        self.state = state
        self.meta = meta
        self.keep = keep
        self.keep_best = keep_best
        self.writer = writer or CheckpointWriter(asynchronous=False)
        self.before_commit = before_commit
        self.after_commit = after_commit
        self.dist = dist or Distributed()
        self._snapshotter = Snapshotter()
        self._last_size = 0
        self.last_saved_step: int | None = None
        self.resumed_from: CheckpointInfo | None = None

    def payload(self) -> dict[str, Any]:
        """Everything an exact resume needs, as plain containers and tensors."""
        payload: dict[str, Any] = {name: (obj.state_dict() if obj is not None else None)
                                   for name, obj in self.objects.items()}
        payload[_TRAIN_STATE] = self.state.state_dict()
        payload[_RNG] = capture_rng()
        return payload

    def save(self, reason: str, metrics: dict[str, float] | None = None, wait: bool = False,
             blocked_since: float | None = None) -> None:
        """Checkpoint the current state. Returns once the state is copied (async) or committed (sync,
        or ``wait=True``). A failure of an earlier background save is raised here as SaveFailed.
        ``blocked_since``: when the caller started waiting for this save (``time.perf_counter()``)."""
        started = time.perf_counter() if blocked_since is None else blocked_since
        if not self.dist.main:  # rank 0 writes; the others only hand it their RNG states
            self.dist.gather(capture_rng())
            self.last_saved_step = self.state.step
            return
        self.writer.wait()  # at most one save in flight; its host buffers are about to be reused
        self._check_free_space()
        payload = self.payload()
        if self.dist.active:
            payload[RNG_RANKS] = self.dist.gather(payload[_RNG])
        if self.writer.asynchronous:
            payload = self._snapshotter.take(payload)
        step = self.state.step
        meta = {
            **self.meta,
            "epoch": self.state.epoch,
            "batch_in_epoch": self.state.batch_in_epoch,
            "reason": reason,
            "metrics": metrics or {},
            "num_threads": torch.get_num_threads(),
        }

        def persist() -> int:
            meta["fingerprint"] = fingerprint(payload["model"], payload["optimizer"])
            if self.before_commit is not None:
                self.before_commit()
            info = self.manager.save(step, payload, meta)
            try:
                self.manager.prune(self.keep, self.keep_best)
            except OSError as e:  # the new checkpoint is committed; a failed prune only leaves extra ones
                print(f"resumable: warning: pruning old checkpoints failed ({e}); they stay on disk and the next "
                      f"save tries again", file=sys.stderr)
            self._last_size = info.size
            if self.after_commit is not None:
                self.after_commit(step)
            return info.size

        self.writer.submit(f"step {step}", persist, blocked_since=started)
        self.last_saved_step = step
        if wait:
            self.writer.wait()

    def _rng_of_this_rank(self, payload: dict[str, Any]) -> dict[str, Any]:
        """This rank's saved RNG states; rank 0's (the single-process ones) when the world size changed."""
        ranks = payload.get(RNG_RANKS)
        if isinstance(ranks, list) and len(ranks) == self.dist.world_size:
            return ranks[self.dist.rank]
        return payload[_RNG]

    def _check_free_space(self) -> None:
        """Warn before a save that will probably hit ENOSPC (the last checkpoint's size is the estimate)."""
        if not self._last_size:
            return
        try:
            free = shutil.disk_usage(self.manager.root).free
        except OSError:
            return
        if free < self._last_size * 1.2:
            print(f"resumable: warning: only {free / 1e6:.0f} MB free in {self.manager.root}, and a checkpoint "
                  f"takes {self._last_size / 1e6:.0f} MB: the next save may fail (free space, or lower --keep)",
                  file=sys.stderr)

    def close(self) -> None:
        """Wait for the last save; raises SaveFailed if it failed."""
        self.writer.wait()

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
        if not os.environ.get("RESUMABLE_TEST_SKIP_RNG_RESTORE"):  # a deliberately broken engine, for chaos tests
            restore_rng(self._rng_of_this_rank(payload))  # last: loading must not consume random numbers after it
        self.last_saved_step = info.step
        self.resumed_from = info
        self._last_size = info.size  # the free-space check has an estimate from the first save on
