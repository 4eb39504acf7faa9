"""Tiered storage: commit locally first (fast), mirror committed checkpoints to a RemoteStore in the
background, and on a fresh machine bring the newest durable checkpoint back before resuming.

A checkpoint is durable remotely only once every payload file is uploaded and verified (size, and md5
where the remote reports one) and then its manifest is uploaded: a remote folder without a manifest is
never a checkpoint. Remote pruning follows local retention and happens only after a newer checkpoint
is durable.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..checkpoint import CheckpointManager
from ..checkpoint import format as fmt
from ..reporting.history import SESSIONS
from ..reporting.tensorboard import TENSORBOARD_DIR
from .base import RemoteFile, RemoteStore
from .retry import MissingFile, StorageError

METRICS = "metrics.jsonl"


def run_logs(run_dir: Path) -> list[tuple[str, Path]]:
    """The run's logs as (remote folder, local file): metrics, sessions and TensorBoard's event files."""
    logs = [("", run_dir / name) for name in (METRICS, SESSIONS)]
    board = run_dir / TENSORBOARD_DIR
    if board.is_dir():
        logs += [(TENSORBOARD_DIR, path) for path in sorted(board.iterdir())]
    return [(folder, path) for folder, path in logs if path.is_file()]


def md5_file(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def remote_manifest(remote: RemoteStore, folder: str, scratch: Path) -> dict | None:
    """The remote manifest of ``folder`` if it is complete (listed files present with their sizes)."""
    try:
        files = remote.list_files(folder)
    except MissingFile:  # the folder was pruned after the checkpoint listing (inspect beside a live run)
        return None
    if fmt.MANIFEST not in files:
        return None
    target = scratch / f".{folder}.manifest"
    try:
        remote.get_file(folder, fmt.MANIFEST, target)
    except MissingFile:  # pruned between listing and reading
        return None
    try:
        manifest = json.loads(target.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    finally:
        target.unlink(missing_ok=True)
    for name, expected in manifest.get("files", {}).items():
        if name not in files or files[name].size != expected.get("size"):
            return None
    return manifest


def describe_remote(remote: RemoteStore, scratch: Path) -> list[dict]:
    """One entry per remote checkpoint folder, oldest first, saying whether it is durable."""
    entries = []
    for folder in remote.list_checkpoints():
        step = fmt.parse_step_dir(folder)
        if step is None:
            continue
        manifest = remote_manifest(remote, folder, scratch)
        entries.append({"step": step, "epoch": (manifest or {}).get("epoch"), "durable": manifest is not None,
                        "valid": manifest is not None,
                        "reason": None if manifest else "incomplete upload (no manifest, or files missing)",
                        "fingerprint": (manifest or {}).get("fingerprint"), "path": f"{remote.description}/{folder}",
                        "created": (manifest or {}).get("created_unix"),
                        "test_acc": ((manifest or {}).get("metrics") or {}).get("test_acc")})
    return sorted(entries, key=lambda e: e["step"])


def durable_steps(remote: RemoteStore, scratch: Path) -> list[int]:
    """Steps whose checkpoint is complete on the remote, oldest first."""
    return [entry["step"] for entry in describe_remote(remote, scratch) if entry["durable"]]


def restore_newest(remote: RemoteStore, local: CheckpointManager, run_dir: Path,
                   say: Callable[[str], None]) -> int | None:
    """If the remote holds a checkpoint newer than every valid local one, download it (payload first,
    sha256-verified, manifest last) with the run's metrics. Returns the step brought back, if any."""
    latest_local, _ = local.latest_valid()
    floor = latest_local.step if latest_local else -1
    local.root.mkdir(parents=True, exist_ok=True)
    for folder in sorted(remote.list_checkpoints(), key=lambda n: fmt.parse_step_dir(n) or -1, reverse=True):
        step = fmt.parse_step_dir(folder)
        if step is None or step <= floor:
            continue
        manifest = remote_manifest(remote, folder, local.root)
        if manifest is None:
            say(f"warning: skipping remote {folder} on {remote.description}: incomplete upload")
            continue
        target = local.root / folder
        target.mkdir(exist_ok=True)
        (target / fmt.MANIFEST).unlink(missing_ok=True)
        for name in manifest["files"]:
            remote.get_file(folder, name, target / name)
        try:
            fmt.verify_files(target, manifest, deep=True)
        except fmt.InvalidCheckpoint as e:
            say(f"warning: remote {folder} on {remote.description} does not verify ({e}); trying an older one")
            continue
        logs = remote.list_files("")
        for log in (METRICS, SESSIONS):
            if log in logs:
                remote.get_file("", log, run_dir / log)
        board = remote.list_files(TENSORBOARD_DIR)
        if board:  # the event files: the resumed session's purge_step drops what followed this checkpoint
            (run_dir / TENSORBOARD_DIR).mkdir(parents=True, exist_ok=True)
            for name in board:
                remote.get_file(TENSORBOARD_DIR, name, run_dir / TENSORBOARD_DIR / name)
        fmt.write_json_atomic(target / fmt.MANIFEST, manifest)
        say(f"brought checkpoint step {step} back from {remote.description}")
        return step
    return None


class Mirror:
    """Keeps ``remote`` in step with the local retention set, on one background thread.

    ``submit(step)`` is called after each local commit. The thread then uploads every locally kept
    checkpoint that is not yet durable remotely, newest first (the most recent progress becomes durable
    soonest), and deletes remote checkpoints that local retention dropped. ``flush(timeout)`` waits at
    exit.
    """

    def __init__(self, local: CheckpointManager, remote: RemoteStore, run_dir: Path,
                 say: Callable[[str], None]) -> None:
        self.local = local
        self.remote = remote
        self.run_dir = run_dir
        self.say = say
        self.durable: set[int] = set(durable_steps(remote, local.root)) if local.root.is_dir() else set()
        self.errors: list[str] = []
        self._log_sizes: dict[tuple[str, str], int] = {}  # what this process uploaded of each log
        self.bytes = 0
        self.upload_s = 0.0
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="resumable-mirror", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        self._idle.clear()
        self._wake.set()

    def _kept(self) -> list[int]:
        return [info.step for info in self.local.inspect(deep=False) if info.valid]

    def pending(self) -> list[int]:
        return sorted(set(self._kept()) - self.durable)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            for step in reversed(self.pending()):
                try:
                    self._upload(step)
                except StorageError as e:
                    self.errors.append(f"step {step}: {e}")
                    self.say(f"warning: mirroring step {step} to {self.remote.description} failed: {e}")
                    break
                except (OSError, fmt.InvalidCheckpoint):
                    continue  # pruned locally meanwhile: nothing to mirror
            try:
                self._prune()
            except StorageError as e:
                self.errors.append(f"pruning: {e}")
            if not self._wake.is_set():
                self._idle.set()

    def _upload(self, step: int) -> None:
        started = time.monotonic()
        folder = fmt.step_dir_name(step)
        source = self.local.root / folder
        manifest = fmt.read_manifest(source)
        for name in sorted(manifest["files"]):
            path = source / name
            got = self.remote.put_file(folder, name, path)
            self._verify(name, path, got)
            self.bytes += got.size
        # The records up to this step are in the logs (flushed before the commit); newer ones are rolled
        # back (metrics) or purged (TensorBoard) on resume. The sessions log is the run's history.
        for log_folder, path in run_logs(self.run_dir):
            self._put_log(log_folder, path)
        self.remote.put_file(folder, fmt.MANIFEST, source / fmt.MANIFEST)  # last: now it exists remotely
        self.durable.add(step)
        self.upload_s += time.monotonic() - started

    def _put_log(self, folder: str, path: Path) -> None:
        """Upload a log that training may be appending to, as a snapshot, unless it is unchanged (logs only
        grow within a process)."""
        key = (folder, path.name)
        if self._log_sizes.get(key) == path.stat().st_size:
            return
        handle, snapshot = tempfile.mkstemp(prefix="resumable-log-")
        os.close(handle)
        try:
            shutil.copyfile(path, snapshot)
            self.remote.put_file(folder, path.name, Path(snapshot))
            self._log_sizes[key] = os.path.getsize(snapshot)
        finally:
            os.unlink(snapshot)

    @staticmethod
    def _verify(name: str, path: Path, got: RemoteFile) -> None:
        size = path.stat().st_size
        if got.size != size:
            raise StorageError(f"{name}: remote has {got.size} bytes, local {size}")
        if got.md5 is not None and got.md5 != md5_file(path):
            raise StorageError(f"{name}: remote md5 {got.md5} does not match the local file")

    def _prune(self) -> None:
        if not self.durable:
            return
        keep = set(self._kept())
        newest = max(self.durable)
        for folder in self.remote.list_checkpoints():
            step = fmt.parse_step_dir(folder)
            if step is not None and step < newest and step not in keep:
                self.remote.delete_folder(folder)
                self.durable.discard(step)

    def flush(self, timeout: float) -> list[int]:
        """Wait up to ``timeout`` s for uploads; returns the kept steps still not durable remotely."""
        self._idle.wait(timeout)
        return self.pending()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
