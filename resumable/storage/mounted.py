"""A mounted Google Drive folder (Colab's /content/drive) treated as slow and unreliable storage.

The mount writes to a local cache and uploads later; it drops with ``OSError: [Errno 107] Transport
endpoint is not connected`` and fails with EIO. Every operation is retried with backoff; a copy is
written under a temporary name, fsynced, renamed, and its size checked afterwards.

The mounted folder may be shared, so it obeys the path policy (checkpoint/paths.py): listings show only plain
names of real folders and regular files (a symlink or FIFO there is skipped, with one warning), names handed in
must be plain, files are read only if regular, and deleting never follows a link.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from ..checkpoint import paths
from ..envvars import env_number
from .base import CHECKPOINTS, RemoteFile, folder_parts
from .retry import MissingFile, RetryPolicy, StorageError, TransientStorageError

COLAB_DRIVE = Path("/content/drive")
# Other Drive mounts (rclone, google-drive-ocamlfuse, a test's flaky folder) can be named here.
MOUNT_ENV = "RESUMABLE_DRIVE_MOUNT"
# On the Colab mount a written file is only in the VM's FUSE cache; Google's client uploads it later. The
# previous checkpoint stays on the mount this long after a newer one was written there (see Mirror).
PRUNE_GRACE_ENV = "RESUMABLE_MOUNT_PRUNE_GRACE_S"
DEFAULT_PRUNE_GRACE_S = 600.0
_TRANSIENT = {errno.ENOTCONN, errno.EIO, errno.ETIMEDOUT, errno.EAGAIN, errno.ESTALE, errno.EBUSY}


def _plain(name: str, where: str) -> None:
    problem = paths.name_problem(name)
    if problem is not None:
        raise StorageError(f"refusing the name {name!r} on {where}: not a plain file name ({problem}); a run folder "
                           f"holds plain names only")


def is_mounted_drive(path: str | os.PathLike[str]) -> bool:
    resolved = Path(path).expanduser().absolute()
    mounts = [COLAB_DRIVE] + ([Path(os.environ[MOUNT_ENV]).absolute()] if os.environ.get(MOUNT_ENV) else [])
    return any(resolved == mount or mount in resolved.parents for mount in mounts)


def _classify(error: BaseException) -> StorageError | None:
    if isinstance(error, OSError):
        if error.errno in _TRANSIENT:
            return TransientStorageError(f"{error} — if this persists, remount Drive: "
                                         "drive.mount('/content/drive', force_remount=True)")
        if error.errno == errno.ENOENT:
            return MissingFile(str(error))
        return StorageError(str(error))
    return None


def _grace_from_env() -> float:
    return env_number(PRUNE_GRACE_ENV, DEFAULT_PRUNE_GRACE_S, inclusive=True)


class MountedDirStore:
    def __init__(self, root: Path, policy: RetryPolicy | None = None, prune_grace_s: float | None = None) -> None:
        """``prune_grace_s``: how long a checkpoint must have been on the mount before the one before it may be
        deleted (default: $RESUMABLE_MOUNT_PRUNE_GRACE_S, else 600 s)."""
        self.root = Path(root)
        self.policy = policy or RetryPolicy()
        self.description = f"mounted folder {self.root}"
        if prune_grace_s is not None and not prune_grace_s >= 0:
            raise ValueError(f"prune_grace_s={prune_grace_s!r} must be a number of seconds >= 0")
        self.prune_grace_s = _grace_from_env() if prune_grace_s is None else float(prune_grace_s)

    def _dir(self, folder: str) -> Path:
        if folder:
            _plain(folder, self.description)
        return self.root.joinpath(*folder_parts(folder))

    def _listed(self, entry: Path, want_dir: bool) -> bool:
        """Whether a listing shows ``entry``: a plain name of a real directory (``want_dir``) or regular file."""
        try:
            mode = entry.lstat().st_mode
        except FileNotFoundError:  # deleted while listing
            return False
        kind_ok = stat.S_ISDIR(mode) if want_dir else stat.S_ISREG(mode)
        problem = paths.name_problem(entry.name)
        if problem is None and kind_ok:
            return True
        odd = not (stat.S_ISDIR(mode) or stat.S_ISREG(mode))  # a link, FIFO, device or socket: worth a warning
        if problem is not None or odd:
            why = problem or f"it is {paths.describe(mode)}"
            paths.warn_once(f"mount:{entry}", f"skipping {entry} on {self.description}: {why}; only plain names of "
                                              f"real folders and regular files are read from it")
        return False

    def _retry(self, action, what: str):
        return self.policy.call(action, _classify, f"{what} on {self.description}")

    def list_checkpoints(self) -> list[str]:
        def listing() -> list[str]:
            base = self.root / CHECKPOINTS
            return sorted(p.name for p in base.iterdir() if self._listed(p, True)) if base.is_dir() else []

        return self._retry(listing, "listing checkpoints")

    def list_files(self, folder: str) -> dict[str, RemoteFile]:
        def listing() -> dict[str, RemoteFile]:
            base = self._dir(folder)
            if not base.is_dir():
                return {}
            return {p.name: RemoteFile(p.lstat().st_size) for p in base.iterdir()
                    if ".tmp-" not in p.name and self._listed(p, False)}

        return self._retry(listing, f"listing {folder or 'the run folder'}")

    def put_file(self, folder: str, name: str, source: Path) -> RemoteFile:
        _plain(name, self.description)
        size = source.stat().st_size

        def copy() -> RemoteFile:
            target_dir = self._dir(folder)
            target_dir.mkdir(parents=True, exist_ok=True)
            tmp = target_dir / f".{name}.tmp-{os.getpid()}"
            tmp.unlink(missing_ok=True)  # O_EXCL below: never write through a link left at that name
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
            with paths.open_regular(source) as src, os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, target_dir / name)
            written = (target_dir / name).stat().st_size
            if written != size:
                raise OSError(errno.EIO, f"{name} has {written} bytes on the mount, expected {size}")
            return RemoteFile(written)

        return self._retry(copy, f"copying {name}")

    def get_file(self, folder: str, name: str, target: Path) -> None:
        _plain(name, self.description)

        def copy() -> None:
            # Only a regular file is read: a FIFO on the mount would block, a link would read another file.
            with paths.open_regular(self._dir(folder) / name) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)

        self._retry(copy, f"reading {name}")

    def delete_file(self, folder: str, name: str) -> None:
        _plain(name, self.description)

        def remove() -> None:
            path = self._dir(folder)
            if not paths.is_real_dir(path):  # gone, or a link: nothing of this run is there (never followed)
                return
            try:  # unlinked, never moved to a trash folder; through a no-follow descriptor of the folder
                paths.unlink_in_dir(path, name)
            except FileNotFoundError:  # the folder went meanwhile
                pass

        self._retry(remove, f"deleting {folder + '/' if folder else ''}{name}")

    def delete_folder(self, folder: str) -> None:
        # On the Colab mount a deleted file goes to Drive's trash (the mount offers no permanent delete);
        # checkpoints here are few and rotate slowly, and the Drive API store deletes permanently.
        def remove() -> None:
            path = self._dir(folder)
            if paths.is_link(path):  # never followed: only the link goes, what it points to stays
                paths.remove_entry(path)
                return
            if not paths.is_real_dir(path):
                return
            paths.unlink_in_dir(path, "manifest.json")  # manifest first: a half-deleted folder is never a checkpoint
            paths.remove_tree(path)

        self._retry(remove, f"deleting {folder}")
