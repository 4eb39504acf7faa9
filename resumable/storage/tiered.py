"""Tiered storage: commit locally first (fast), mirror committed checkpoints to a RemoteStore in the
background, and on a fresh machine bring the newest durable checkpoint back before resuming (restore.py).

A checkpoint is durable remotely only once every payload file is uploaded and verified (size, and md5
where the remote reports one) and then its manifest is uploaded: a remote folder without a manifest is
never a checkpoint. A file already durable in an older checkpoint's folder is not uploaded again: the
remote manifest places it there (placement.py). Remote pruning follows local retention and happens only
after a newer checkpoint is durable.

The remote is untrusted (anyone may write to a shared Drive folder): a remote manifest is validated like a local
one, and file names from it or from a listing must be plain names (checkpoint/paths.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..checkpoint import CheckpointManager, paths
from ..checkpoint import format as fmt
from ..checkpoint import manifest as manifests
from ..reporting.history import SESSIONS
from ..reporting.tensorboard import TENSORBOARD_DIR
from . import placement
from .base import RemoteFile, RemoteStore, run_of, same_run
from .durable import describe_remote, durable_steps, md5_of, remote_checkpoints, remote_manifest
from .pace import UploadPace
from .placement import Listings, Placements
from .restore import METRICS, restore_newest
from .retry import StorageError
from .upload import SourceUnreadable

# durable.py's and restore.py's too, for the callers that knew them here
__all__ = ["Mirror", "describe_remote", "durable_steps", "remote_checkpoints", "restore_newest"]


def run_logs(run_dir: Path | None) -> list[tuple[str, Path]]:
    """The run's logs as (remote folder, local file): metrics, sessions and TensorBoard's event files (none without
    a run dir: a Trainer's output dir keeps its own logs)."""
    if run_dir is None:
        return []
    logs = [("", run_dir / name) for name in (METRICS, SESSIONS)]
    board = run_dir / TENSORBOARD_DIR
    if paths.is_real_dir(board):  # a link there points outside the run dir: nothing of it is uploaded
        logs += [(TENSORBOARD_DIR, path) for path in sorted(board.iterdir())]
    # Regular files only (lstat): a symlinked log would upload someone else's file, a FIFO would hang.
    return [(folder, path) for folder, path in logs if paths.is_regular(path)]


class _Closed(Exception):
    """Raised on the mirror's thread at its next remote call after close(): the thread stops there."""


class Mirror:
    """Keeps ``remote`` in step with the local retention set, on one background thread.

    ``submit(step)`` is called after each local commit. The thread then uploads every locally kept
    checkpoint that is not yet durable remotely, newest first (the most recent progress becomes durable
    soonest), and deletes remote checkpoints that local retention dropped — but only those older than a
    checkpoint that has been durable for ``remote.prune_grace_s`` (a mount uploads from its cache later), and
    never one of another run than ``run_id``. ``flush(timeout)`` waits at exit; ``close()`` stops it.

    A file whose bytes an older remote checkpoint of this run already holds is not uploaded again, and a pruned
    folder keeps the files newer checkpoints use (placement.py): ``bytes`` counts what was uploaded,
    ``reused_bytes`` what was not.

    ``lost``: why this process no longer owns the run dir (its Drive lease was taken over), or None. Once it says
    so, nothing more is uploaded or deleted: the new owner's checkpoints and pruning are its own.

    >>> mirror = Mirror(manager, remote, run_dir, print, run_id=run_id)  # doctest: +SKIP
    """

    def __init__(self, local: CheckpointManager, remote: RemoteStore, run_dir: Path | None,
                 say: Callable[[str], None], run_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 lost: Callable[[], str | None] = lambda: None,
                 after_upload: Callable[[], None] | None = None) -> None:
        self.local = local
        self.remote = remote
        self.run_dir = run_dir
        self.say = say
        self.run_id = run_id  # None: unknown, every remote checkpoint may be this run's (older manifests)
        self.clock = clock
        self.lost = lost
        self.stopped_by: str | None = None  # why the thread stopped changing the remote (the lease was lost)
        self.durable: set[int] = set()
        # Steps this mirror made durable itself: only those may justify pruning. One found on the remote at start may
        # be ahead of a local cache that fell behind (a restore that failed), and its older neighbours are then the
        # checkpoints this session may still need.
        self.uploaded: set[int] = set()
        self._runs: dict[int, str | None] = {}  # run id of each remote step read or uploaded
        self.placements = Placements()  # where the remote stores the bytes of each file (placement.py)
        if local.root.is_dir():
            for step, folder, manifest in remote_checkpoints(remote, local.root, local.layout):
                self._runs[step] = run_of(manifest)
                if manifest is not None:
                    ours = same_run(run_of(manifest), run_id)
                    self.placements.learn(folder, manifest, ours)
                    if ours:
                        self.durable.add(step)
        # Found on the remote: how long ago it became durable is unknown, so it counts from now.
        self._durable_at: dict[int, float] = dict.fromkeys(self.durable, clock())
        self.errors: list[str] = []
        self._log_sizes: dict[tuple[str, str], int] = {}  # what this process uploaded of each log
        self.bytes = 0  # uploaded
        self.reused_bytes = 0  # not uploaded: already durable in an older remote checkpoint's folder
        self.upload_s = 0.0
        self.pace = UploadPace()  # how fast checkpoints get there: the session budget reserves the last one's upload
        self.uploading: int | None = None  # the step in flight: local retention keeps it (see protected())
        self.after_upload = after_upload  # local retention again, once the step in flight is up
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        # Makes "request a pass" and "the pass found no new request, so idle" atomic to each other: a request
        # landing between the thread's check and its idle.set() would let flush() return before its pass.
        self._signal = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="resumable-mirror", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        """Called after the local commit of ``step``: the thread uploads every pending step, then prunes."""
        self._request()

    def _request(self) -> None:
        with self._signal:
            self._idle.clear()
            self._wake.set()

    def _kept(self) -> list[int]:
        return [info.step for info in self.local.inspect(deep=False) if info.valid]

    def durability(self) -> tuple[list[int], list[int]]:
        """The locally kept steps as (durable on the remote, only local), oldest first."""
        kept = sorted(set(self._kept()))
        return [s for s in kept if s in self.durable], [s for s in kept if s not in self.durable]

    def pending(self) -> list[int]:
        return sorted(set(self._kept()) - self.durable)

    def protected(self) -> set[int]:
        """Steps local retention must keep for now: the one being uploaded. Pruned in the middle of its upload,
        it would be skipped for the newest, and with checkpoints that come faster than an upload takes, each
        newest would be pruned in turn: nothing would become durable until training stopped."""
        step = self.uploading
        return set() if step is None else {step}

    def _check_open(self) -> None:
        """Called before every remote call that starts an upload or a deletion: after close() (the run may
        have released its Drive lease) or once the lease was taken over by another machine, this process must
        not change the remote any more."""
        if self._closed:
            raise _Closed
        lost = self.lost()
        if lost is not None:
            if self.stopped_by is None:
                self.stopped_by = lost
                self.say(f"warning: stopped mirroring to {self.remote.description}: {lost}; nothing more is "
                         f"uploaded or deleted by this process")
            raise _Closed

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                self._check_open()
                self._pass()
                with self._signal:
                    if not self._wake.is_set():
                        self._idle.set()
        except _Closed:
            return
        finally:
            self._idle.set()  # flush() never waits on a thread that has stopped

    def _pass(self) -> None:
        listings = Listings(self.remote)  # each origin folder of a reused file is listed once per pass
        for step in reversed(self.pending()):
            self._check_open()
            try:
                self._upload(step, listings)
            except (StorageError, SourceUnreadable) as e:
                if self._gone(step):  # pruned locally meanwhile: nothing to mirror, and no failure (not retried)
                    continue
                self.errors.append(f"step {step}: {e}")
                self.say(f"warning: mirroring step {step} to {self.remote.description} failed: {e}")
                break
            except (OSError, fmt.InvalidCheckpoint):
                continue  # pruned locally meanwhile: nothing to mirror
            if self._wake.is_set():  # a newer checkpoint was committed: it goes first (a new pass), older ones after
                break
        self._check_open()
        try:
            self._prune()
        except StorageError as e:
            self.errors.append(f"pruning: {e}")

    def _gone(self, step: int) -> bool:
        """Whether local retention dropped ``step`` (its manifest goes first): its upload failing is no failure."""
        return not paths.is_regular(self.local.folder(step) / fmt.MANIFEST)

    def _upload(self, step: int, listings: Listings) -> None:
        started = time.monotonic()
        source = self.local.folder(step)
        folder = source.name
        self.uploading = step  # before its manifest is read: a prune from now on keeps it
        try:
            manifest = manifests.read(source).body
        except BaseException:
            self.uploading = None
            raise
        reused: dict[str, str] = {}
        md5: dict[str, str] = {}
        self.pace.begin(sum(entry["size"] for entry in manifest["files"].values()))
        try:
            for name, entry in sorted(manifest["files"].items()):
                where = self.placements.find(name, entry, step, listings)
                if where is not None:  # the same bytes are durable there: the remote manifest points at them
                    reused[name] = where
                    self.reused_bytes += entry["size"]
                    self.pace.skip(entry["size"])
                    continue
                path = source / name
                self._check_open()
                got = self.remote.put_file(folder, name, path)
                self._verify(name, path, got)
                self.bytes += got.size
                self.pace.sent(got.size)
                md5.update({name: got.md5} if got.md5 else {})
            self._finish(step, folder, source, manifest, reused, md5, listings)
        finally:
            self.pace.end(completed=step in self.durable)
            self.uploading = None
        self.upload_s += time.monotonic() - started
        if self.after_upload is not None:  # a prune that kept this step for its upload may drop it now
            self.after_upload()

    def _finish(self, step: int, folder: str, source: Path, manifest: dict, reused: dict[str, str],
                md5: dict[str, str], listings: Listings) -> None:
        """After the payload: the logs, then the manifest (now the checkpoint exists remotely). The manifest uploaded
        is the one read before the payload, and only while the local folder still holds it: a folder written again
        meanwhile (its manifest goes first, see CheckpointManager.invalidate) may have sent a mix of old and new
        files, and is uploaded afresh after its new commit."""
        listings.forget(folder)
        # The records up to this step are in the logs (flushed before the commit); newer ones are rolled
        # back (metrics) or purged (TensorBoard) on resume. The sessions log is the run's history.
        for log_folder, path in run_logs(self.run_dir):
            self._put_log(log_folder, path)
        body = placement.remote_body(manifest, reused, md5)  # Drive's md5s: later checks compare without downloading
        if manifests.read(source).body != manifest:  # InvalidCheckpoint when it is gone: skipped like a pruned step
            raise fmt.InvalidCheckpoint(f"{source} was committed again while it was being uploaded")
        self._put_manifest(folder, body)
        self.placements.learn(folder, body, True, md5)
        self._runs[step] = run_of(manifest)
        self._durable_at[step] = self.clock()  # on a mount: in its cache now, uploaded by Google later
        self.durable.add(step)
        self.uploaded.add(step)

    def durable_at(self, step: int) -> float | None:
        """When ``step`` became durable remotely (``clock`` time; found there at start: the start), if it is."""
        return self._durable_at.get(step) if step in self.durable else None

    def _put_manifest(self, folder: str, body: dict) -> None:
        """Upload the manifest ``body``, last: now the checkpoint exists remotely. Written to a scratch folder first
        (the remote one may differ from the local file: it places files in older folders, and records md5s)."""
        scratch = Path(tempfile.mkdtemp(prefix=f".remote-manifest{fmt.TMP_MARK}", dir=self.local.root))
        try:
            path = scratch / fmt.MANIFEST
            fmt.write_json_atomic(path, body)
            self._check_open()
            self.remote.put_file(folder, fmt.MANIFEST, path)
            self.pace.sent(path.stat().st_size)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

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
            self._check_open()
            self.remote.put_file(folder, path.name, Path(snapshot))
            self._log_sizes[key] = os.path.getsize(snapshot)
            self.pace.sent(self._log_sizes[key])
        finally:
            os.unlink(snapshot)

    @staticmethod
    def _verify(name: str, path: Path, got: RemoteFile) -> None:
        size = path.stat().st_size
        if got.size != size:
            raise StorageError(f"{name}: remote has {got.size} bytes, local {size}")
        if got.md5 is not None and got.md5 != md5_of(path):
            raise StorageError(f"{name}: remote md5 {got.md5} does not match the local file")

    def _prune(self) -> None:
        """Delete remote checkpoints that local retention dropped, once a newer one has settled.

        Settled: durable for at least ``remote.prune_grace_s``. Only checkpoints older than the newest settled
        one go, so one that has had time to upload always stays, and with no grace (the Drive API) this is
        "older than the newest durable one". That anchor is a step this mirror uploaded itself (``uploaded``),
        never one only found on the remote, and nothing at or past the newest valid local step goes: a session
        whose cache is behind the remote leaves the remote's newer checkpoints alone. Runs after every pass:
        later submits and flush() retry it.
        """
        if not self.uploaded:
            return
        grace = float(getattr(self.remote, "prune_grace_s", 0.0))
        now = self.clock()
        settled = [step for step in self.durable & self.uploaded if now - self._durable_at.get(step, now) >= grace]
        keep = set(self._kept())
        if not settled or not keep:
            return
        anchor = min(max(settled), max(keep))
        doomed = [(step, folder) for folder in self.remote.list_checkpoints()
                  if (step := self.local.layout.parse(folder)) is not None and step < anchor and step not in keep
                  and self._ours(step, folder)]
        # Files the checkpoints that stay place in a doomed folder keep it, as a holder of just those (placement.py).
        in_use = self.placements.in_use(folder for _, folder in doomed)
        for step, folder in doomed:
            if folder not in in_use:
                self._check_open()
                self.remote.delete_folder(folder)
                self.placements.dropped(folder)
                self._runs.pop(step, None)
            elif self.placements.needs_work(folder, in_use[folder]):  # its run id stays known, as a holder's
                self._check_open()
                deleted = placement.make_holder(self.remote, folder, in_use[folder])
                self.placements.held(folder, in_use[folder], deleted)
            self.durable.discard(step)
            self.uploaded.discard(step)
            self._durable_at.pop(step, None)

    def _ours(self, step: int, folder: str) -> bool:
        """Whether the remote folder may belong to this run; one of another run is never deleted."""
        if self.run_id is None:
            return True
        if step not in self._runs:  # appeared after this mirror looked (or was pruned and re-made)
            self._check_open()
            manifest = remote_manifest(self.remote, folder, self.local.root)
            if manifest is not None:  # its placements keep files too
                self.placements.learn(folder, manifest, False)
            self._runs[step] = run_of(manifest)
        return same_run(self._runs[step], self.run_id)

    def flush(self, timeout: float, stop: Callable[[], bool] | None = None) -> list[int]:
        """Upload what is pending and prune (a grace that has run out since the last submit ends now); wait up
        to ``timeout`` s, or until ``stop()`` (a second interrupt). Returns the kept steps still not durable
        remotely."""
        if not self._closed:
            self._request()
        deadline = time.monotonic() + timeout
        while not self._idle.wait(min(0.1, max(deadline - time.monotonic(), 0.0))):
            if time.monotonic() >= deadline or (stop is not None and stop()):
                break
        return self.pending()

    def close(self, timeout: float | None = None) -> bool:
        """Stop mirroring: from now on the thread starts no upload, prune or deletion (what is pending stays
        local; call flush first to wait for it). A remote call already in progress finishes; this waits up
        to ``timeout`` s (None: for as long as it takes) and returns whether the thread has stopped, so a
        caller releases the Drive lease only once nothing can touch the remote any more."""
        self._closed = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return not self._thread.is_alive()
