"""Binds the stateful objects of a run to its checkpoints: what goes into one, and how it comes back.

A checkpoint's payload holds every object's ``state_dict()``, the replicated :class:`TrainState`, the
train/eval mode of every module, and one entry per DDP rank (``ranks``: that rank's RNG streams and per-rank
counters), so DDP correctness does not depend on remembering which values differ between ranks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ... import log
from ...checkpoint import CheckpointInfo, CheckpointManager, InvalidCheckpoint, dcp, digests, fingerprint
from ...checkpoint import format as fmt
from ...checkpoint.memory import PeakMemory
from ...checkpoint.retention import BY_TEST_ACC, Best
from ...checkpoint.staging import Staging, default_budget
from ...checkpoint.tree import map_leaves
from ...checkpoint.writer import CheckpointWriter
from ...distributed import Distributed
from ...errors import NothingToResume, ResumableError, SaveFailed
from ...faults import NO_FAULTS, Faults
from ..data import content_check
from . import determinism, hardware, room
from .compatibility import check_computation
from .fits import check_fits, check_position
from .frozen import FrozenTensors
from .shards import IN_DCP, MARK, Shards
from .train_state import DATA_NEXT, RANKS, RNG, Stateful, TrainState, capture_rng, rank_state, restore_rng
from .verify import verify_restored

# Payload keys that are not user objects.
_TRAIN_STATE, _MODES = fmt.TRAIN_STATE, "module_modes"


def owned(state: Any) -> Any:
    """``state`` with every tensor copied into memory of its own. A loaded payload's tensors are views of the
    checkpoint's files (mapped, so that restoring costs no second copy of the model); an object that keeps them
    (an optimizer's moments) would keep the file's space allocated after retention deleted it."""
    return map_leaves(state, lambda _path, leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf)


class StateKeeper:
    """Saves and restores ``objects`` (name → Stateful), the TrainState, module modes and every RNG stream.

    ``meta`` is recorded in each manifest (config, dataset identity, computation fields, run id). With an
    asynchronous ``writer``, ``save`` copies the state into the staging memory (``staging_memory`` bytes; the
    part that does not fit is written before it returns) and returns; writing, hashing, fsync, commit and pruning
    happen on the writer's thread. Frozen tensors of the model are left out unless ``store_frozen``
    (engine/state/frozen.py). ``before_commit`` runs on the writer's thread just before the checkpoint is committed
    (e.g. to make logs durable up to this step), ``after_commit(step)`` after it is committed and pruned (e.g. to
    mirror it to Drive). ``protect()`` names steps retention keeps for now (the one being uploaded).
    """

    def __init__(self, manager: CheckpointManager, objects: Mapping[str, Stateful | None],
                 state: TrainState, meta: dict[str, Any], keep: int = 3, keep_best: bool = True,
                 writer: CheckpointWriter | None = None,
                 before_commit: Callable[[], None] | None = None,
                 after_commit: Callable[[int], None] | None = None, dist: Distributed | None = None,
                 faults: Faults = NO_FAULTS, modules: torch.nn.Module | None = None, store_frozen: bool = False,
                 staging_memory: int | None = None, protect: Callable[[], set[int]] | None = None,
                 fresh: frozenset[str] = frozenset(), best: Best = BY_TEST_ACC) -> None:
        if "model" not in objects or "optimizer" not in objects:
            raise ValueError("a keeper needs at least 'model' and 'optimizer' objects")
        self.manager = manager
        self.objects = dict(objects)
        self.state = state
        self.meta = meta
        self.keep = keep
        self.keep_best = keep_best
        self.best = best  # the metric and direction of the checkpoint keep_best keeps
        self.before_commit = before_commit
        self.after_commit = after_commit
        self.protect = protect  # steps retention keeps for now (the one the Drive mirror is uploading)
        self._prune_lock = threading.Lock()  # the writer's thread and the mirror's both prune
        self.faults = faults
        self.modules = modules if modules is not None else objects.get("model")
        # A sharded model (FSDP2) and its optimizer are saved by every rank through DCP (checkpoint/dcp.py); the
        # payload rank 0 writes holds a marker in their place. Frozen tensors are kept whole there.
        self.writer = writer or CheckpointWriter(asynchronous=False)
        self.dist = dist or Distributed()
        self.shards = (Shards(objects["model"], objects["optimizer"], self.dist, self.writer.asynchronous)
                       if dcp.is_sharded(objects.get("model")) else None)
        self.sharded = self.shards is not None
        self.frozen = FrozenTensors(None if self.sharded else objects.get("model"),
                                    [o for o in objects.values() if hasattr(o, "param_groups")],
                                    store_all=store_frozen)
        self.staging_memory = staging_memory  # None: chosen from the free host memory at the first save
        self._staging: Staging | None = None
        self._frozen_record: dict[str, Any] = {}
        self._told_direct = False
        self._last_size = 0
        self.last_saved_step: int | None = None
        self.resumed_from: CheckpointInfo | None = None
        self.restore_cost: PeakMemory | None = None  # time and host memory the restore took
        self.verified: str | None = None  # what the verification of the last restore checked, and its time
        self.data_next: dict[str, Any] | None = None  # this rank's record of its next batch at the restored step
        # Objects a checkpoint may hold no state for (None): they keep their fresh state. The GradScaler of an AMP
        # switch (bf16 checkpoint, fp16 session: engine/state/hardware.py); any other missing state is an error.
        self.fresh = fresh

    # -- saving ------------------------------------------------------------------------------------
    def _rank_state(self, rng: dict[str, Any] | None = None) -> dict[str, Any]:
        """What differs per rank: RNG streams, counters, and the record of the data this rank reads next
        (engine/data/content_check.py: compared with the first batch after a resume)."""
        return {"rng": capture_rng() if rng is None else rng, "counters": self.state.rank_dict(),
                DATA_NEXT: content_check.upcoming(self.objects.get("sampler"), self.state.epoch,
                                               self.state.batch_in_epoch)}

    def _modes(self) -> list[bool]:
        return [m.training for m in self.modules.modules()] if isinstance(self.modules, torch.nn.Module) else []

    def payload(self) -> dict[str, Any]:
        """Everything an exact resume needs, as plain containers and tensors (this rank's view)."""
        payload: dict[str, Any] = {name: (obj.state_dict() if obj is not None else None)
                                   for name, obj in self.objects.items() if not (self.sharded and name in IN_DCP)}
        if self.sharded:
            payload.update(dict.fromkeys(IN_DCP, MARK))
        payload["model"], self._frozen_record = self.frozen.split(payload["model"])
        payload[_TRAIN_STATE] = self.state.state_dict()
        payload[RNG] = capture_rng()
        payload[_MODES] = self._modes()
        return payload

    def save(self, reason: str, metrics: dict[str, float] | None = None, wait: bool = False,
             blocked_since: float | None = None) -> None:
        """Checkpoint the current state. Returns once the state is copied (async) or committed (sync,
        or ``wait=True``). A failure of an earlier background save is raised here as SaveFailed.
        ``blocked_since``: when the caller started waiting for this save (``time.perf_counter()``)."""
        started = time.perf_counter() if blocked_since is None else blocked_since
        if self.shards is not None:  # every rank writes its shards of model and optimizer first
            self.writer.wait()  # rank 0: the previous save's folder is committed (or failed) before a new one begins
            self.shards.save(self.manager, self.state.step, self._discard_unfinished)
        if not self.dist.main:  # rank 0 writes; the others only hand it their own state
            self.dist.gather(self._rank_state())
            self.last_saved_step = self.state.step
            if wait:
                self.wait_shards()
            return
        self.writer.wait()  # at most one save in flight; its host buffers are about to be reused
        room.warn_if_short(self.manager.root, self._last_size)
        payload = self.payload()
        payload[RANKS] = self.dist.gather(self._rank_state(payload[RNG]))
        step = self.state.step
        meta = {
            **self.meta,
            "epoch": self.state.epoch,
            "batch_in_epoch": self.state.batch_in_epoch,
            "reason": reason,
            "metrics": metrics or {},
            "num_threads": torch.get_num_threads(),
            "determinism": determinism.settings(),
            **({"frozen": self._frozen_record} if self._frozen_record else {}),
            **({"trainable": self.frozen.trainable()} if self.frozen.model is not None else {}),
            **({"sharded": dcp.KIND} if self.sharded else {}),
        }
        if not self.manager.root.parent.is_dir():  # the run dir was deleted under us: never recreated by a save
            raise SaveFailed(f"saving the checkpoint of step {step} failed: the run dir {self.manager.root.parent} "
                             f"is gone (deleted while training?); nothing is recreated there")
        try:
            directory = self.manager.begin(step)
        except OSError as e:  # a read-only or vanished checkpoints folder: a failed save, never a traceback
            raise SaveFailed(f"saving the checkpoint of step {step} failed: cannot create its folder in "
                             f"{self.manager.root} ({e.strerror or e})") from e
        try:  # the training thread's part: every tensor staged, or written when it does not fit the staging memory
            pending = self.manager.state_format.begin(directory, payload, self.manager.previous_files(step),
                                                      self._staging_for() if self.writer.asynchronous else None)
        except OSError as e:
            self._discard_unfinished(step)
            raise SaveFailed(f"saving the checkpoint of step {step} failed: {e}") from e
        except BaseException:
            self._discard_unfinished(step)
            raise
        self._tell_direct(pending, step, started)
        abandoned = threading.Event()  # set when the session gives up on this save (stuck): it must not commit
        shards = self.shards.pending if self.shards is not None else None  # waited for on the writer's thread

        def persist() -> int:
            try:
                written = pending.finish()
                meta["fingerprint"], meta["fingerprint_version"] = written.fingerprint, written.fingerprint_version
                if self.sharded:  # every rank's shards, once on disk
                    written.files.update(Shards.files(directory, shards))
                    meta["fingerprint"] = dcp.fingerprint(written.fingerprint, written.files)
                if self.before_commit is not None:
                    self.before_commit()
                info = self.manager.commit(step, written.files, meta, abandoned=abandoned)
            except BaseException:
                if not abandoned.is_set():  # an abandoned save leaves its files to the next start's clean-up
                    self._discard_unfinished(step)  # a disk full for a while gets its space back for the next save
                raise
            self.prune()
            self._last_size = info.size
            self.writer.stats.linked += written.linked
            if self.after_commit is not None:
                self.after_commit(step)
            return written.written

        self.writer.submit(f"step {step}", persist, blocked_since=started, abandoned=abandoned)
        self.last_saved_step = step
        if wait:
            self.writer.wait()

    def wait_shards(self) -> None:
        """This rank's shards of the last background save are on disk (a sharded model); SaveFailed if not."""
        if self.shards is not None:
            self.shards.wait()

    def prune(self) -> None:
        """Apply retention: after each commit on the writer's thread, and on the Drive mirror's once the step it
        kept for its upload is durable (``protect``)."""
        with self._prune_lock:
            try:
                self.manager.prune(self.keep, self.keep_best, self.protect() if self.protect is not None else set(),
                                   self.best)
            except OSError as e:  # the new checkpoint is committed; a failed prune only leaves extra ones
                log.warning(f"pruning old checkpoints failed ({e}); they stay on disk and the next save tries again")

    def _staging_for(self) -> Staging:
        """The staging memory of asynchronous saves (made once; its buffer is allocated by the first save)."""
        if self._staging is None:
            budget = self.staging_memory if self.staging_memory is not None else default_budget()
            self._staging = Staging(budget)
        return self._staging

    def _tell_direct(self, pending: Any, step: int, started: float) -> None:
        """Say once why save() blocked training for longer than a copy: the state did not fit the staging memory."""
        direct = getattr(getattr(pending, "result", None), "direct", 0)
        if not direct or not self.writer.asynchronous or self._told_direct:
            return
        self._told_direct = True
        staged = pending.result.staged
        capacity = self._staging.capacity if self._staging is not None else 0
        log.info(f"checkpoint of step {step}: training waited {time.perf_counter() - started:.2f}s while "
                 f"{direct / 1e6:.0f} MB were written directly, because the staging memory "
                 f"({capacity / 1e6:.0f} MB, --staging-memory) holds less than the state "
                 f"({(staged + direct) / 1e6:.0f} MB); {staged / 1e6:.0f} MB were staged and are written in the "
                 f"background. Raise --staging-memory to stage all of it")

    def _discard_unfinished(self, step: int) -> None:
        """After a failed save: remove its temp files and its step dir, if it has no manifest (best effort; the
        next start's cleanup catches what is left). A symlinked step dir is never followed."""
        directory = self.manager.folder(step)
        try:
            if directory.is_symlink() or not directory.is_dir() or (directory / fmt.MANIFEST).exists():
                return
            for entry in directory.iterdir():
                if entry.is_file() or entry.is_symlink():
                    entry.unlink()
            directory.rmdir()
        except OSError as e:
            log.warning(f"could not remove the unfinished save {directory} ({e}); the next start removes it")

    def check_room(self) -> None:
        """At start: refuse to train when the disk cannot hold one more checkpoint (the last one's size), with
        the figures, instead of failing every save (nothing is changed)."""
        room.check(self.manager.root, self._last_size)

    def close(self) -> None:
        """Wait for the last save; raises SaveFailed if it failed."""
        self.wait_shards()
        self.writer.wait()

    def release(self) -> None:
        """The session's saves are over: what the background shard saves held goes (a sharded model)."""
        if self.shards is not None:
            self.shards.release()

    # -- restoring ---------------------------------------------------------------------------------
    def restore(self, info: CheckpointInfo) -> None:
        """Load ``info`` into every object. Raises InvalidCheckpoint before touching anything if the
        payload is unreadable, incomplete or does not match its manifest's fingerprint."""
        with PeakMemory() as memory:
            self._restore(info)
        self.restore_cost = memory

    def _restore(self, info: CheckpointInfo) -> None:
        sharded = info.manifest.get("sharded") == dcp.KIND
        if sharded != self.sharded:
            raise InvalidCheckpoint(f"it was written by a run whose model was {'' if sharded else 'not '}sharded "
                                    f"(FSDP), and this run's is {'' if self.sharded else 'not '}sharded: wrap the "
                                    f"model as the run that wrote it did")
        if sharded:
            dcp.check_ranks(info.manifest)
        frozen = info.manifest.get("frozen") or {}
        self.frozen.check(frozen, info.step)  # the script's base weights, before anything is read or changed
        trainable = self.frozen.saved_trainable(info.manifest.get("trainable"))  # InvalidCheckpoint if malformed
        located: dict[tuple[Any, ...], tuple[str, str]] = {}  # sharded tensor -> (shard, key)
        payload = self.manager.load(info, located)
        expected = set(self.objects) | {_TRAIN_STATE, RNG}
        missing = sorted(expected - set(payload))
        if missing:
            raise InvalidCheckpoint(f"payload lacks {missing}")
        if not sharded:  # before it is walked (fingerprint) or loaded into anything
            check_fits(self.objects, payload, set(frozen), lambda: self.frozen.trainable_difference(trainable))
        version = info.manifest.get("fingerprint_version", 1)
        found = (digests.of_payload(payload, version, info.verified_digests(located))
                 if version in (digests.VERSION, digests.TENSOR_VERSION)
                 else fingerprint(payload["model"], payload["optimizer"]))
        if sharded:  # the shards' sha256 (checked with every file of the manifest) are part of it
            found = dcp.fingerprint(found, info.manifest["files"])
        if found != info.fingerprint:
            raise InvalidCheckpoint("payload does not match the manifest's training-state fingerprint")
        check_position(payload[_TRAIN_STATE], info.manifest)
        rng, counters, self.data_next = rank_state(payload, self.dist.rank, self.dist.world_size)
        self.frozen.restore_trainable(trainable, info.step)  # trainable flags are state (gradual unfreezing)
        built = self.frozen.built(payload["model"] if isinstance(payload["model"], dict) else ())
        fresh = {name for name in self.fresh if payload.get(name) is None}
        checked = None
        if self.shards is not None:  # this rank's shards, resharded from any world size; a collective on every rank
            checked = self.shards.load(info.path)
        for name, obj in self.objects.items():
            if obj is None or name in fresh or (sharded and name in IN_DCP):
                continue
            if payload[name] is None:
                raise InvalidCheckpoint(f"checkpoint has no {name} state but this run uses one")
            if name == "model" and isinstance(obj, torch.nn.Module):  # copied into the parameters and buffers
                obj.load_state_dict(payload[name], strict=not frozen)  # check_fits: only frozen keys are absent
            else:  # an optimizer keeps the tensors it is given: its own copies, not views of a checkpoint file
                obj.load_state_dict(owned(payload[name]))
        self.frozen.loaded(built)  # what the script built and the checkpoint agrees with may be left out again
        self.state.load_state_dict(payload[_TRAIN_STATE])
        if counters is not None:
            self.state.load_rank_dict(counters)
        self._restore_modes(payload.get(_MODES))
        if not self.faults.skip_rng_restore:
            restore_rng(rng)  # last: loading must not consume random numbers after it
        restored = {name: obj for name, obj in self.objects.items() if name not in fresh}
        self.verified = verify_restored(restored, payload, self.state, rng, check_rng=not self.faults.skip_rng_restore,
                                        sharded=checked)
        self.last_saved_step = info.step
        self.resumed_from = info
        self._last_size = info.size  # the free-space check has an estimate from the first save on

    def _restore_modes(self, modes: Any) -> None:
        if not isinstance(self.modules, torch.nn.Module) or not isinstance(modes, list):
            return
        modules = list(self.modules.modules())
        if len(modules) == len(modes):  # the same model; a different one fails its load_state_dict anyway
            for module, training in zip(modules, modes, strict=True):
                module.training = bool(training)

    def resume(self, latest: CheckpointInfo, skipped: list[CheckpointInfo], computation: dict[str, Any],
               run_dir: str, api: bool, ignore: frozenset[str] = frozenset(),
               accept: Mapping[str, tuple[Any, Any]] | None = None) -> CheckpointInfo:
        """Restore the newest checkpoint that verifies and loads, warning about each one skipped.

        Under DDP every rank tries the same candidates in the same order and they agree on each one (one small
        all_gather), so all ranks resume from one checkpoint: a candidate that is unusable on every rank is
        skipped everywhere, one usable on some ranks only is an error on all of them."""
        manager = self.manager
        older = (manager.check(step, path, deep=True) for step, path in reversed(manager.step_dirs())
                 if step < latest.step)
        reasons: list[str] = []
        for info in (*skipped, latest, *older):
            problem, fatal = self._try(info, computation, run_dir, api, ignore, accept)
            verdicts = self.dist.all_errors(f"{'fatal' if fatal else 'skip'}:{problem}" if problem else None)
            if fatal is not None:
                raise fatal
            if any(message.startswith("fatal:") for _, message in verdicts):
                rank, message = next((r, m) for r, m in verdicts if m.startswith("fatal:"))
                raise ResumableError(f"rank {rank} could not resume from {info.path}: {message[6:]}")
            if not verdicts:
                for difference in determinism.differences(info.manifest.get("determinism"), determinism.settings()):
                    log.warning(f"{difference}: bit-identity with the uninterrupted run is only promised when the "
                                f"determinism settings match the checkpoint's")
                versions = determinism.version_difference(info.manifest.get("torch_version"))
                if versions is not None:
                    log.warning(versions)
                moved = hardware.cross_device_line(info.manifest, self.meta)
                if moved is not None:
                    log.warning(moved)
                return info
            if len(verdicts) < self.dist.world_size:
                rank, message = verdicts[0]
                raise ResumableError(f"rank {rank} cannot use checkpoint step {info.step} ({message[5:]}) but other "
                                     f"ranks can: every rank must see the same run dir ({run_dir}); check its "
                                     f"storage and permissions on that rank's machine")
            reason = verdicts[0][1][5:]
            log.warning(f"skipping checkpoint step {info.step} ({info.path}): {reason}")
            reasons.append(f"step {info.step}: {reason}")
        found = "; ".join(reasons) or "none"
        raise NothingToResume(f"no checkpoint of {run_dir} could be loaded ({found}); fix the cause, or start over "
                              f"with --fresh --overwrite (which deletes them) or use another --run-dir")

    def _try(self, info: CheckpointInfo, computation: dict[str, Any], run_dir: str, api: bool,
             ignore: frozenset[str], accept: Mapping[str, tuple[Any, Any]] | None = None,
             ) -> tuple[str | None, ResumableError | None]:
        """Load ``info`` into every object: (why it was skipped, None), (None, None) when loaded, or (message,
        error) when resuming must stop. Never raises, so every rank reaches the agreement in :meth:`resume`."""
        if not info.valid:
            return info.reason, None
        try:
            check_computation(info.manifest.get("computation", {}), computation, run_dir, api, ignore, accept)
            threads = info.manifest.get("num_threads")
            if isinstance(threads, int) and threads != torch.get_num_threads():
                log.info(f"setting torch threads to {threads} (was {torch.get_num_threads()}) as recorded in the "
                         f"checkpoint, so CPU results stay bit-identical")
                torch.set_num_threads(threads)
            self.restore(info)
        except InvalidCheckpoint as e:  # raised before any object is modified
            return str(e), None
        except OSError as e:  # this rank cannot read it (permissions, a missing mount): never a model mismatch
            return f"{info.path} cannot be read ({e})", None
        except ResumableError as e:
            return str(e), e
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            detail = " ".join(str(e).split())  # torch's message spans lines; the error stays one line
            error = ResumableError(f"the checkpoint {info.path} does not fit this model/optimizer ({detail}); use "
                                   f"the matching options, or start over with --fresh --overwrite")
            return str(error), error
        return None, None
