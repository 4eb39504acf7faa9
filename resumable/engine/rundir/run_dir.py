"""The run dir: where a run lives, who owns it, and which checkpoint a new session starts from.

Opening a run dir resolves ``--run-dir`` (a local folder, a mounted Drive folder or ``gdrive://``), takes its
lock (and the Drive lease) *before* anything in it is read or changed, brings a newer checkpoint back from
Drive into the local cache, and picks the checkpoint to resume. Under DDP rank 0 does all of it and tells the
other ranks; an error on rank 0 is raised on every rank instead of leaving them waiting.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ... import log, platforms
from ...checkpoint import CheckpointInfo, CheckpointManager, checkpoints_dir
from ...distributed import Distributed
from ...envvars import env_number
from ...errors import NothingToResume, ResumableError, RunDirInUse
from ...reporting.history import SESSIONS, read_sessions
from ...reporting.metrics import METRICS
from ...reporting.tensorboard import TENSORBOARD_DIR
from ...storage import RunLocation, StorageError, open_run_location
from ...storage.lease import DriveLease
from ...storage.restore import RestoreFailed
from ...storage.tiered import restore_newest
from .crash_loop import check_crash_loop
from .lock import RunLock
from .rewind import choose_step, set_aside_newer

# How often the Drive lease is renewed and checked for a takeover (default 60 s). A takeover is noticed within
# one beat, so tests set it short to see a run stop without waiting a minute.
LEASE_HEARTBEAT_ENV = "RESUMABLE_LEASE_HEARTBEAT_S"


def lease_heartbeat_s() -> float:
    try:
        return env_number(LEASE_HEARTBEAT_ENV, 60.0)
    except ValueError as e:
        raise ResumableError(str(e)) from None


@dataclass
class Choice:
    """The checkpoint a session starts from (None: fresh), newer ones that failed verification, and the id
    of the run (inherited from the checkpoint, new for a fresh start)."""

    latest: CheckpointInfo | None
    skipped: list[CheckpointInfo] = field(default_factory=list)
    run_id: str = ""


def choose_checkpoint(manager: CheckpointManager, run_dir: str, mode: str, overwrite: bool,
                      resume_from: int | None = None) -> Choice:
    """The checkpoint to resume; modifies nothing.

    ``mode``: ``auto`` resumes when there is a valid checkpoint, ``resume`` requires one, ``fresh`` starts over
    (and needs ``overwrite`` to discard existing checkpoints). ``resume_from``: that step's checkpoint instead of the
    newest (engine/rundir/rewind.py)."""
    if resume_from is not None:
        if mode == "fresh":
            raise ResumableError("--resume-from continues from a checkpoint and --fresh starts over: give one of them")
        latest = choose_step(manager, run_dir, resume_from)
        run_id = (latest.manifest or {}).get("run_id")
        return Choice(latest, [], run_id if isinstance(run_id, str) and run_id else uuid.uuid4().hex)
    committed = [i for i in manager.inspect(deep=False) if i.committed]
    if mode == "fresh":
        if committed and not overwrite:
            raise RunDirInUse(f"{run_dir} already has {len(committed)} checkpoint(s) (newest step "
                              f"{committed[-1].step}); --fresh would discard them. Add --overwrite to delete them, "
                              f"or choose another --run-dir")
        return Choice(None, [], uuid.uuid4().hex)
    latest, skipped = manager.latest_valid()  # hashes newest-first, stops at the first valid one
    if latest is not None:
        run_id = (latest.manifest or {}).get("run_id")
        return Choice(latest, skipped, run_id if isinstance(run_id, str) and run_id else uuid.uuid4().hex)
    if mode == "resume":
        found = "; ".join(f"step {i.step}: {i.reason}" for i in skipped[::-1]) or "no checkpoints at all"
        raise NothingToResume(f"--resume needs a valid checkpoint in {manager.root}, found: {found}. "
                              f"Run without --resume to start fresh")
    if committed:
        found = "; ".join(f"step {i.step}: {i.reason}" for i in skipped[::-1] if i.committed)
        raise NothingToResume(f"{run_dir} has checkpoints but none is valid ({found}); refusing to start over "
                              f"on top of them. Use --fresh --overwrite to discard them, or another --run-dir")
    return Choice(None, [], uuid.uuid4().hex)


class RunDir:
    """One opened run dir. Rank 0 holds its lock (and Drive lease) from :meth:`open` to :meth:`release`."""

    def __init__(self, name: str, location: RunLocation, lock: RunLock | None = None,
                 lease: DriveLease | None = None) -> None:
        self.name = name
        self.location = location
        self.lock = lock
        self.lease = lease
        self.taken_over: str | None = None  # the message when a stale lock/lease was taken over
        self.identity: tuple[str, str] | None = None  # (code, config) digests (engine/session/identity.py)

    @property
    def local(self) -> Path:
        return self.location.local_dir

    @property
    def remote(self):  # noqa: ANN201 - a RemoteStore or None
        return self.location.remote

    @property
    def manager(self) -> CheckpointManager:
        return CheckpointManager(checkpoints_dir(self.local))

    @property
    def lost(self) -> str | None:
        """Why this process no longer owns the run dir (its lock or lease was taken over, or the run dir was deleted
        under it), if so."""
        if self.lock is not None:
            self.lock.gone()  # a deleted run dir sets its lost (one stat a second at most)
        for owner in (self.lock, self.lease):
            if owner is not None and owner.lost:
                return owner.lost
        return None

    @classmethod
    def open(cls, dist: Distributed, run_dir: str, cache_dir: str | None, credentials: str | None, mode: str,
             overwrite: bool, resume_from: int | None = None, ignore_crash_loop: bool = False,
             identity: tuple[str, str] | None = None) -> tuple[RunDir, Choice]:
        """Open and lock the run dir (rank 0), bring Drive's newest checkpoint back and pick the one to resume
        (see :func:`choose_checkpoint`), unless the last sessions make a crash loop there (engine/rundir/crash_loop.py)
        for this ``identity`` (the session's code and config digests). Raises ResumableError on every rank if rank 0
        cannot."""
        if not dist.main:
            chosen = dist.broadcast(None)
            if isinstance(chosen, ResumableError):
                raise chosen
            opened = cls(run_dir, _location(run_dir, cache_dir, credentials))
            opened.identity = identity
            return opened, chosen
        opened: RunDir | None = None
        if platforms.outside_kaggle_working(run_dir):
            log.warning(f"Kaggle: the run dir {run_dir} is outside {platforms.KAGGLE_WORKING}, the only folder a saved "
                        f"version keeps: its checkpoints are lost with this session. Put it under "
                        f"{platforms.KAGGLE_WORKING} (e.g. {platforms.KAGGLE_WORKING / 'runs' / Path(run_dir).name})")
        try:
            opened = cls(run_dir, _location(run_dir, cache_dir, credentials))
            opened.identity = identity
            opened._claim()
            opened._check_entries()
            if opened.taken_over:
                log.info(opened.taken_over)
            if resume_from is not None and opened.remote is not None:
                raise ResumableError(f"--resume-from is not supported for Drive run dirs yet ({run_dir}): the newer "
                                     f"checkpoints on Drive would come back at the next start. Copy the step dir you "
                                     f"want into a new run dir's checkpoints/ folder and train there")
            if opened.remote is not None and not (mode == "fresh" and overwrite):
                opened._restore()
            chosen = choose_checkpoint(opened.manager, run_dir, mode, overwrite, resume_from)
            if mode != "fresh" and not ignore_crash_loop and chosen.latest is not None:  # never with nothing committed
                step = chosen.latest.step
                older = [i.step for i in opened.manager.inspect(deep=False) if i.valid and i.step < step]
                code, config = identity if identity is not None else (None, None)
                check_crash_loop(read_sessions(opened.local, warn=False), step, older, run_dir, code, config)
            if resume_from is not None:
                set_aside_newer(opened.manager, opened.local, resume_from)
        except OSError as e:  # a full or read-only disk at start: exit 2 with the cause, not a traceback
            error = ResumableError(f"cannot open the run dir {run_dir} ({e}); free space or fix permissions, then "
                                   f"run again")
            if opened is not None:
                opened.release()
                opened._undo_create()
            dist.broadcast(error)
            raise error from e
        except ResumableError as e:
            if opened is not None:
                opened.release()
                opened._undo_create()
            dist.broadcast(e)
            raise
        dist.broadcast(chosen)
        return opened, chosen

    def _claim(self) -> None:
        """Take the lock, then the lease: nothing in the run dir is read or changed before."""
        self._created = not self.local.exists()
        self.lock = RunLock(self.local)
        self.taken_over = self.lock.acquire()  # raises RunDirInUse
        if self.remote is not None:
            self.lease = DriveLease(self.remote, heartbeat_s=lease_heartbeat_s())
            try:
                self.taken_over = self.lease.acquire() or self.taken_over
            except StorageError as e:
                raise ResumableError(f"cannot take the lease on {self.remote.description}: {e}") from e

    def _check_entries(self) -> None:
        """The run dir's own entries must be of the kind resumable keeps there, or nothing could be committed (a
        file named ``checkpoints`` would fail every save until the run ends); exit 2 naming it, nothing changed."""
        kinds = {"checkpoints": ("a folder", Path.is_dir), TENSORBOARD_DIR: ("a folder", Path.is_dir),
                 METRICS: ("a file", Path.is_file), SESSIONS: ("a file", Path.is_file)}
        for name, (kind, right) in kinds.items():
            path = self.local / name
            if (path.exists() or path.is_symlink()) and not right(path):
                found = "a broken link" if not path.exists() else "a folder" if path.is_dir() else "not a folder"
                raise ResumableError(f"{path} is {found}, but resumable keeps its {name} there as {kind}: move it "
                                     f"away or use another --run-dir (nothing was changed)")

    def _restore(self) -> None:
        log.info(f"run dir {self.name} is mirrored from a local cache in {self.local}")
        try:
            restore_newest(self.remote, self.manager, self.local, log.info)
        except RestoreFailed as e:  # committed checkpoints there, none usable: never a fresh start over them
            raise ResumableError(str(e)) from e
        except StorageError as e:
            raise ResumableError(f"cannot look for checkpoints on {self.remote.description}: {e}. "
                                 f"Nothing was changed; run again when it is reachable") from e

    def reset(self) -> None:
        """--fresh --overwrite: delete the checkpoints and logs, here and on Drive (under the lock).

        Never through a symlink (checkpoint/paths.py): a step dir or the TensorBoard dir that is a link is removed
        itself, with a warning, and nothing outside the run dir changes."""
        from ...checkpoint import paths

        self.manager.delete_all()
        for name in (METRICS, SESSIONS):
            (self.local / name).unlink(missing_ok=True)  # unlink removes a link itself
        try:
            paths.remove_entry(self.local / TENSORBOARD_DIR)
        except OSError as e:  # old event files only confuse TensorBoard; the fresh run goes on
            log.warning(f"could not delete {self.local / TENSORBOARD_DIR} ({e}); delete it by hand")
        if self.remote is not None:
            for folder in [*self.remote.list_checkpoints(), TENSORBOARD_DIR]:
                self.remote.delete_folder(folder)

    def _undo_create(self) -> None:
        """A start that was refused leaves no trace: remove the run dir if this start created it (empty)."""
        if getattr(self, "_created", False):
            try:
                self.local.rmdir()
            except OSError:
                pass  # not empty (someone else's files), or gone: leave it

    def release(self) -> None:
        """Give the run dir up: the lease first (Drive), then the local lock. Never raises: a run dir remounted
        read-only at the end must not turn a finished run into a traceback (a lock left behind goes stale)."""
        for owner in (self.lease, self.lock):
            if owner is None:
                continue
            try:
                owner.release()
            except (OSError, StorageError) as e:
                log.warning(f"could not release {type(owner).__name__} of {self.name} ({e}); it goes stale by itself")
        self.lease = self.lock = None


def _location(run_dir: str, cache_dir: str | None, credentials: str | None) -> RunLocation:
    try:
        return open_run_location(run_dir, cache_dir, credentials)
    except (StorageError, ValueError) as e:
        raise ResumableError(str(e)) from e
