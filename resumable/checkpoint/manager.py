"""Save, list, validate, load and prune checkpoints in one directory, whatever their folders are named (layout.py).

Commit protocol for a save: invalidate any old manifest of that step (:meth:`CheckpointManager.begin`), write
the payload files (each a temp file, fsync, rename; see state_format.py and sharded.py), then write
``manifest.json`` atomically (:meth:`CheckpointManager.commit`). Pruning runs only after a commit and removes a
checkpoint's manifest first, so a prune interrupted half-way never leaves a directory that looks valid. A folder
another program wrote (the Trainer's ``checkpoint-N``) is committed the same way by :meth:`CheckpointManager.adopt`.
"""

from __future__ import annotations

import math
import os
import platform
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import SaveFailed
from ..faults import NO_FAULTS, Faults
from . import format as fmt
from . import manifest as manifests
from . import paths
from .adopt import listed_files
from .layout import STEPS, Layout
from .manifest import note as manifest_note
from .manifest import seal
from .retention import BY_TEST_ACC, Best, Candidate, steps_to_prune
from .sharded import META, ShardedFormat
from .state_format import Previous, StateFormat, TorchFile
from .treehash import FileDigests


@dataclass
class CheckpointInfo:
    """One checkpoint folder (``step-N``, ``checkpoint-N``) and whether it is a valid checkpoint (``reason`` says
    why not)."""

    step: int
    path: Path
    manifest: dict[str, Any] | None
    reason: str | None = None
    # The tensor digests of its shards found by a deep check in this process (shard name -> what was hashed): a
    # resume combines its training-state fingerprint from them instead of hashing the payload again.
    digests: dict[str, FileDigests] | None = field(default=None, repr=False, compare=False)

    @property
    def valid(self) -> bool:
        return self.reason is None

    @property
    def committed(self) -> bool:
        """A manifest was written (a save that did not finish leaves none)."""
        return (self.path / fmt.MANIFEST).exists()

    def _get(self, key: str) -> Any:
        return (self.manifest or {}).get(key)

    # The manifest was validated when read (manifest.py); the type checks here keep the properties safe for a
    # CheckpointInfo built from an unchecked dict (e.g. a remote listing), where a bad value reads as unknown.
    @property
    def epoch(self) -> int | None:
        return _integer(self._get("epoch"))

    @property
    def created(self) -> float | None:
        value = self._get("created_unix")
        return float(value) if _finite(value) else None

    @property
    def fingerprint(self) -> str | None:
        value = self._get("fingerprint")
        return value if isinstance(value, str) else None

    @property
    def metrics(self) -> dict[str, Any]:
        """What evaluate() returned for this checkpoint's step, as the manifest records it ({} if none)."""
        metrics = self._get("metrics")
        return metrics if isinstance(metrics, dict) else {}

    @property
    def test_acc(self) -> float | None:
        return Best("test_acc").value(self.metrics)

    @property
    def size(self) -> int:
        files = self._get("files")
        entries = files.values() if isinstance(files, dict) else ()
        return sum(_integer(e.get("size")) or 0 for e in entries if isinstance(e, dict))

    @property
    def format_version(self) -> int | None:
        return _integer(self._get("format_version"))

    @property
    def note(self) -> str | None:
        """Why a valid checkpoint is checked less than a current one (a format 1 manifest), or None."""
        return manifest_note(self.manifest) if self.valid else None

    def verified_digests(self, located: dict[tuple[Any, ...], tuple[str, str]]) -> dict[tuple[Any, ...], str]:
        """The tensor digests its deep check in this process computed (path -> hex) for the tensors ``located`` in its
        shards (path -> (shard, key), as :meth:`CheckpointManager.load` fills it), so that the training-state
        fingerprint does not hash those bytes again. Only a file that is still the one hashed (same inode, size and
        modification time) counts; whatever is not here is hashed from the loaded payload."""
        known: dict[tuple[Any, ...], str] = {}
        current: dict[str, bool] = {}
        for path, (shard, key) in located.items():
            found = (self.digests or {}).get(shard)
            if found is None or key not in found.tensors:
                continue
            if shard not in current:
                current[shard] = found.current(self.path / shard)
            if current[shard]:
                known[path] = found.tensors[key]
        return known

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "valid": self.valid, "reason": self.reason,
                "fingerprint": self.fingerprint, "path": str(self.path), "created": self.created,
                "size": self.size, "test_acc": self.test_acc, "metrics": self.metrics,
                "best": self._get("best") if isinstance(self._get("best"), dict) else None}


class CheckpointManager:
    """Checkpoints under ``root`` (``RUN_DIR/checkpoints``; a Trainer's ``OUTPUT_DIR`` with ``layout=TRAINER``)."""

    def __init__(self, root: Path, state_format: StateFormat | None = None, faults: Faults = NO_FAULTS,
                 layout: Layout = STEPS) -> None:
        self.root = Path(root)
        self.state_format = state_format or ShardedFormat(faults=faults)
        self.faults = faults
        self.layout = layout

    def folder(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is (or goes)."""
        return self.root / self.layout.name(step)

    # -- listing and validation -------------------------------------------------------------------
    def _step_entries(self) -> list[tuple[int, Path]]:
        """Every entry named for a step in the root, whatever it is, oldest first by step number (never by name or
        mtime: ``checkpoint-9`` is older than ``checkpoint-10``)."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            step = self.layout.parse(entry.name)
            if step is not None:
                found.append((step, entry))
        return sorted(found)

    def step_dirs(self) -> list[tuple[int, Path]]:
        """Every checkpoint directory, oldest first by step number.

        Only real directories: a symlink named like a step dir points outside the run dir, and listing it would
        make retention delete (and resume read) files there. It is reported once and removed, as a link only, by
        the next start's :meth:`cleanup_incomplete`."""
        found = []
        for step, entry in self._step_entries():
            if paths.is_real_dir(entry):
                found.append((step, entry))
            else:
                paths.warn_once(f"step-entry:{entry}", f"{entry} is {paths.kind_of(entry)}, not a checkpoint "
                                f"directory: ignored (the next start removes it; a link is removed itself, never "
                                f"what it points to)")
        return found

    def check(self, step: int, path: Path, deep: bool = True) -> CheckpointInfo:
        try:
            manifest = manifests.read(path).body
        except fmt.InvalidCheckpoint as e:
            return CheckpointInfo(step, path, None, str(e))
        if manifest["step"] != step:
            return CheckpointInfo(step, path, manifest, f"manifest says step {manifest['step']}, but its folder is "
                                                        f"{path.name}")
        try:
            found = fmt.verify_files(path, manifest, deep=deep)
        except fmt.InvalidCheckpoint as e:
            return CheckpointInfo(step, path, manifest, str(e))
        return CheckpointInfo(step, path, manifest, digests=found if deep else None)

    def inspect(self, deep: bool = True) -> list[CheckpointInfo]:
        return [self.check(step, path, deep) for step, path in self.step_dirs()]

    def latest_valid(self) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
        """The newest fully verified checkpoint, and the newer directories skipped as invalid."""
        skipped = []
        for step, path in reversed(self.step_dirs()):
            info = self.check(step, path, deep=True)
            if info.valid:
                return info, skipped
            skipped.append(info)
        return None, skipped

    # -- save, load, clean ------------------------------------------------------------------------
    def save(self, step: int, payload: dict[str, Any], meta: dict[str, Any]) -> CheckpointInfo:
        """Write and commit the checkpoint of ``step`` at once; returns it once the manifest is durable."""
        directory = self.begin(step)
        written = self.state_format.begin(directory, payload, self.previous_files(step)).finish()
        return self.commit(step, written.files, {**meta, "fingerprint": written.fingerprint,
                                                  "fingerprint_version": written.fingerprint_version})

    def begin(self, step: int) -> Path:
        """The step dir of a new save, with any old manifest of that step removed first (re-saving a step after
        falling back past a corrupt one), so nothing there counts until :meth:`commit`."""
        self.root.mkdir(parents=True, exist_ok=True)
        directory = self.folder(step)
        if os.path.lexists(directory) and not paths.is_real_dir(directory):
            paths.remove_entry(directory)  # a link there would make this save write outside the run dir
        directory.mkdir(exist_ok=True)
        self.invalidate(step)
        return directory

    def invalidate(self, step: int) -> None:
        """The folder of ``step`` is about to be written again (by this manager, or by the Trainer after a resume
        from an older checkpoint): its old manifest goes first, so the folder does not count while its files are
        replaced."""
        directory = self.folder(step)
        if paths.is_real_dir(directory) and paths.unlink_in_dir(directory, fmt.MANIFEST):
            fmt.fsync_dir(directory)

    def previous_files(self, step: int) -> dict[str, Previous]:
        """The files of the newest committed checkpoint before ``step`` (manifest checked, payload not read), which
        identical new shards are hard-linked to."""
        for older, path in reversed(self.step_dirs()):
            if older >= step:
                continue
            try:
                manifest = manifests.read(path).body
            except fmt.InvalidCheckpoint:
                continue
            return {name: Previous(path / name, entry["size"], entry["sha256"], entry.get(fmt.DIGEST))
                    for name, entry in manifest["files"].items()}
        return {}

    def commit(self, step: int, files: dict[str, dict[str, Any]], meta: dict[str, Any], *,
               abandoned: threading.Event | None = None) -> CheckpointInfo:
        """Write the manifest of a step dir whose files are on disk: from now on it is a checkpoint. ``abandoned``
        set: the session gave up on this save (it was stuck), so it must not become a checkpoint now."""
        directory = self.folder(step)
        self.faults.before_commit(step, abandoned)
        if abandoned is not None and abandoned.is_set():
            raise SaveFailed(f"the save of step {step} was abandoned (stuck); it is not committed")
        manifest = seal({
            **meta,
            "format": fmt.FORMAT_NAME,
            "format_version": fmt.FORMAT_VERSION,
            "step": step,
            "files": files,
            "created_unix": time.time(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            **({"metrics": _plain_metrics(meta["metrics"])} if isinstance(meta.get("metrics"), dict) else {}),
        })  # sealed last: manifest_sha256 covers every field above
        fmt.write_json_atomic(directory / fmt.MANIFEST, manifest)
        fmt.fsync_dir(self.root)
        return CheckpointInfo(step, directory, manifest)

    def adopt(self, step: int, meta: dict[str, Any]) -> CheckpointInfo:
        """Commit the folder of ``step`` as another program wrote it (the Trainer's ``checkpoint-N``): every file
        hashed and fsynced (adopt.py), then the manifest, last."""
        directory = self.folder(step)
        files = listed_files(directory)
        fmt.fsync_dir(directory)
        return self.commit(step, files, meta)

    def load(self, info: CheckpointInfo,
             located: dict[tuple[Any, ...], tuple[str, str]] | None = None) -> dict[str, Any]:
        """The payload of ``info``, whatever its format (state.pt, or shards and meta.pt); ``located`` receives the
        shard and key of each sharded tensor (path -> (shard, key))."""
        return read_any(info.path, info.manifest or {}, self.state_format.load_timeout_s, located)

    def cleanup_incomplete(self) -> list[Path]:
        """Remove temp files and step directories a killed save left without a manifest, and checkpoint entries
        that are not directories (a symlink is removed itself, and said; nothing it points to changes)."""
        removed: list[Path] = []
        if not self.root.is_dir():
            return removed
        for entry in self.root.iterdir():
            if fmt.TMP_MARK in entry.name:  # a temp file, or a scratch folder of a Drive listing (tiered.py)
                paths.remove_entry(entry)
                removed.append(entry)
        for _, path in self._step_entries():
            if not paths.is_real_dir(path):
                paths.remove_entry(path)
                removed.append(path)
                continue
            for entry in path.iterdir():
                if fmt.TMP_MARK in entry.name:
                    paths.remove_entry(entry)
                    removed.append(entry)
            if not os.path.lexists(path / fmt.MANIFEST):
                paths.remove_tree(path)
                removed.append(path)
        return removed

    def prune(self, keep: int, keep_best: bool, protect: set[int] | frozenset[int] = frozenset(),
              best: Best = BY_TEST_ACC) -> list[int]:
        """Delete committed checkpoints beyond the retention policy (the ``keep`` newest, and the best by ``best``'s
        metric as each manifest records it when ``keep_best``), and the folders without a manifest older than
        the newest valid checkpoint (saves killed before their commit); returns the deleted steps. Folders newer
        than it are left alone (a save may be writing there), and so are committed ones that do not verify."""
        found = self.inspect(deep=False)
        valid = [info for info in found if info.valid]
        if not valid:
            return []
        doomed = set(steps_to_prune([Candidate(i.step, best.value(i.metrics)) for i in valid], keep, keep_best, protect,
                                    best))
        doomed |= {info.step for info in found
                   if not info.committed and info.step < valid[-1].step and info.step not in protect}
        for info in found:
            if info.step in doomed:
                self.delete(info.path)
        return sorted(doomed)

    def delete(self, path: Path) -> None:
        """Delete one checkpoint, manifest first, so a half-deleted directory is never valid. Never follows a
        symlink: one at ``path`` is removed itself (and said), its target is outside the run dir."""
        if not paths.is_real_dir(path):
            paths.remove_entry(path)
            return
        # Through a no-follow descriptor of the step dir: a link swapped in meanwhile cannot redirect the unlink.
        if not paths.is_real_dir(path / fmt.MANIFEST):
            paths.unlink_in_dir(path, fmt.MANIFEST)
        paths.remove_tree(path)

    def delete_all(self) -> None:
        """Every checkpoint entry (--fresh --overwrite): directories deleted, links removed as links."""
        for _, path in reversed(self._step_entries()):
            self.delete(path)


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _plain_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as the manifest may hold them: a NaN loss or a non-numeric metric of a user's evaluate() is
    recorded as null (metrics.jsonl keeps the value), so it never makes the checkpoint unreadable."""
    return {str(k): v if _finite(v) else None for k, v in metrics.items()}


def describe_age(created: float | None) -> str:
    if created is None:
        return "unknown age"
    seconds = max(time.time() - created, 0.0)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "checkpoints"


def read_any(directory: Path, manifest: dict[str, Any], load_timeout_s: float | None = None,
             located: dict[tuple[Any, ...], tuple[str, str]] | None = None) -> dict[str, Any]:
    """The state of a checkpoint of any format: sharded when its manifest lists ``meta.pt``, else ``state.pt``."""
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    if META in files:
        return ShardedFormat(load_timeout_s=load_timeout_s).read(directory, manifest, located)
    return TorchFile(load_timeout_s).read(directory, manifest)
