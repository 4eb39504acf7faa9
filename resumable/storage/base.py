"""The one seam between checkpoints and where they are mirrored: a directory tree of small files.

Local training always commits to a fast local directory first (see tiered.py); a RemoteStore holds the
durable copy: a mounted Google Drive folder (mounted.py) or the Drive API (gdrive.py). Finding the
newest checkpoint and retention work on names and manifests only and never import pydrive2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..reporting.tensorboard import TENSORBOARD_DIR

CHECKPOINTS = "checkpoints"
RUN_FOLDERS = frozenset({TENSORBOARD_DIR})  # folders of the run root itself; any other folder is a checkpoint's


def folder_parts(folder: str) -> tuple[str, ...]:
    """Where ``folder`` lives in the run folder: "" is the run root, a RUN_FOLDERS name sits beside
    ``checkpoints/``, and any other name is a checkpoint folder inside it."""
    if not folder:
        return ()
    return (folder,) if folder in RUN_FOLDERS else (CHECKPOINTS, folder)


def run_of(manifest: dict[str, Any] | None) -> str | None:
    """The run id a manifest names; None ("unknown": older manifests have none) for anything else."""
    run = (manifest or {}).get("run_id")
    return run if isinstance(run, str) and run else None


def same_run(a: str | None, b: str | None) -> bool:
    """Whether two run ids may be one run; an unknown id is compatible with anything."""
    return a is None or b is None or a == b


@dataclass(frozen=True)
class RemoteFile:
    size: int
    md5: str | None = None  # Drive reports md5Checksum; a mounted folder does not
    # Drive only (None elsewhere), not part of equality: the file's id, to read back exactly the file written (a
    # listing lags behind a write; a get by id does not), and its modifiedDate, to tell which copy is newer.
    file_id: str | None = field(default=None, compare=False)
    modified: str | None = field(default=None, compare=False)


class RemoteStore(Protocol):
    """Files addressed by (folder, name); folder is "" for the run root, a checkpoint dir name, or one of
    RUN_FOLDERS (see folder_parts)."""

    description: str
    # Seconds a checkpoint must have been durable before the Mirror may prune the one before it. The Drive
    # API verifies what it stored (0); a mount only has the file in its local cache and uploads it later.
    prune_grace_s: float

    def list_checkpoints(self) -> list[str]:
        """Names of the checkpoint folders (``step-*``)."""
        ...

    def list_files(self, folder: str) -> dict[str, RemoteFile]: ...

    def put_file(self, folder: str, name: str, source: Path) -> RemoteFile:
        """Upload ``source``, replacing a file of that name; returns what the remote verified."""
        ...

    def get_file(self, folder: str, name: str, target: Path) -> None: ...

    def delete_file(self, folder: str, name: str) -> None:
        """Delete one file permanently (not to the trash); a file or folder that is not there is no error."""
        ...

    def delete_folder(self, folder: str) -> None:
        """Delete a folder permanently (not to the trash); a folder that is not there is no error."""
        ...
