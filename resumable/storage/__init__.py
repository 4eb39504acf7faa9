"""Where a run lives: a local folder, a mounted Drive folder, or gdrive:// through the Drive API.

Remote run dirs are tiered: checkpoints commit to a local cache first and are mirrored in the
background (tiered.py).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..envvars import env_number
from .base import RemoteFile, RemoteStore
from .gdrive import DriveLocation, GDriveStore, is_drive_url, misspelt_drive_url
from .mounted import MountedDirStore, is_mounted_drive
from .retry import RetryPolicy, StorageError, TransientStorageError
from .upload import DEFAULT_CHUNK, check_chunk_size

UPLOAD_SESSIONS = ".upload-sessions"  # in the local cache of a gdrive:// run dir: sessions of unfinished uploads

__all__ = ["RemoteFile", "RemoteStore", "RetryPolicy", "RunLocation", "StorageError", "TransientStorageError",
           "default_cache_dir", "open_run_location"]


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "resumable"


@dataclass
class RunLocation:
    local_dir: Path  # where checkpoints commit first (the run dir itself when it is local)
    remote: RemoteStore | None  # the durable copy, for mounted-Drive and gdrive:// run dirs


def open_run_location(run_dir: str, cache_dir: str | None = None, credentials: str | None = None,
                      timeout: float | None = None, policy: RetryPolicy | None = None) -> RunLocation:
    """Resolve ``--run-dir``: a plain path is used as is; a mounted Drive path or gdrive:// URL gets a
    local cache (``--cache-dir``/<hash of the run dir>) and a remote store. A misspelt Drive URL (``gdrive:/x``) is
    refused here, before anything is created, with its right spelling: every run dir (resumable-train, Run,
    inspect, verify, chaos, the Trainer callback's ``drive=``) is resolved through this function."""
    right = misspelt_drive_url(run_dir)
    if right is not None:
        raise ValueError(f"run dir {run_dir!r} looks like a Google Drive URL: write {right} (gdrive://root/<path> "
                         f"in My Drive, gdrive://<folder-id>/<path> in a shared folder); for a local folder of that "
                         f"name write ./{run_dir}")
    remote: RemoteStore | None = None
    # pydrive2 has no HTTP timeout by default: a stalled connection would hang training's exit forever.
    timeout = timeout or env_number("RESUMABLE_DRIVE_TIMEOUT", 60.0)
    policy = policy or RetryPolicy.from_env()
    local_dir = cache_path(run_dir, cache_dir)
    if is_drive_url(run_dir):
        from pydrive2.drive import GoogleDrive

        from .auth import make_gauth

        location = DriveLocation.parse(run_dir)  # a malformed URL is reported before any authentication
        chunk = drive_chunk_size()
        remote = GDriveStore(GoogleDrive(make_gauth(credentials, timeout)), location, policy, url=run_dir,
                             sessions_dir=local_dir / UPLOAD_SESSIONS, chunk_size=chunk)
    elif is_mounted_drive(run_dir):
        remote = MountedDirStore(Path(run_dir), policy)
    if remote is None:
        return RunLocation(Path(run_dir), None)
    return RunLocation(local_dir, remote)


def cache_path(run_dir: str, cache_dir: str | Path | None = None) -> Path:
    """The local cache of a remote run dir: ``--cache-dir``/<last name>-<hash of the run dir>."""
    slug = hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]
    name = str(run_dir).rstrip("/").rsplit("/", 1)[-1] or "run"
    return Path(cache_dir or default_cache_dir()) / f"{name}-{slug}"


def drive_chunk_size() -> int:
    """The Drive upload chunk size: RESUMABLE_DRIVE_CHUNK_MIB (a multiple of 0.25), 8 MiB by default."""
    text = os.environ.get("RESUMABLE_DRIVE_CHUNK_MIB")
    try:
        mib = env_number("RESUMABLE_DRIVE_CHUNK_MIB", DEFAULT_CHUNK / (1024 * 1024), what="a number of MiB")
        return check_chunk_size(int(mib * 1024 * 1024))
    except ValueError:
        raise ValueError(f"RESUMABLE_DRIVE_CHUNK_MIB={text!r} is not a positive multiple of 0.25 (Drive takes "
                         f"chunks in multiples of 256 KiB); use e.g. 8") from None
