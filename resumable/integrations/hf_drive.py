"""Mirroring a Trainer's committed ``checkpoint-N`` folders to Google Drive through resumable's tiered store.

The Mirror (storage/tiered.py) and :func:`restore_newest` work on a CheckpointManager root of ``step-N`` folders
(``step_dir_name``, ``parse_step_dir`` and the remote's ``checkpoints/step-N`` layout are used throughout
storage/). Rather than teach them a second naming, this adapter keeps such a root beside the Trainer's folders:
``OUTPUT_DIR/.resumable/<name>-<hash of the Drive location>/checkpoints/step-N``, whose files are *hard links* of
``checkpoint-N``'s (no copy, no extra disk; a copy where links are not possible), the manifest linked last. So:

* Drive holds exactly what ``resumable-train`` writes (``checkpoints/step-N`` with a manifest uploaded last), and
  ``resumable inspect gdrive://...`` reads it; Drive retention follows the local one (a step pruned here goes).
* On a fresh VM, :meth:`DriveLink.restore` brings the newest durable ``step-N`` into the view (verified sha256 by
  sha256) and links it back as ``checkpoint-N`` before the Trainer looks for a checkpoint.

The aliasing a hard link brings is handled where the Trainer could write into a linked file: before it saves a
step again (a resume from an older checkpoint), :meth:`DriveLink.forget` deletes that step from the view first.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .. import log
from ..checkpoint import CheckpointManager, paths
from ..checkpoint import format as fmt
from ..checkpoint import manifest as manifests
from ..storage import open_run_location
from ..storage.restore import restore_newest
from ..storage.tiered import Mirror
from . import hf_checkpoints as hf

VIEW = ".resumable"  # in OUTPUT_DIR; the Trainer only looks at checkpoint-* entries


def _link(source: Path, target: Path) -> None:
    """``target`` becomes the same file as ``source`` (a copy where hard links are not possible)."""
    if os.path.lexists(target):
        paths.remove_entry(target)
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)


def link_folder(source: Path, target: Path, manifest: dict) -> None:
    """Make ``target`` hold ``source``'s listed files and then, last, its manifest (a link at ``target`` is
    removed, never written through). Whatever manifest ``target`` had goes first."""
    target = paths.real_dir(target, log.warning)
    hf.invalidate(target)
    for name in manifest["files"]:
        _link(source / paths.plain_name(name, f"{source / fmt.MANIFEST}"), target / name)
    fmt.fsync_dir(target)
    _link(source / fmt.MANIFEST, target / fmt.MANIFEST)
    fmt.fsync_dir(target)


class DriveLink:
    """The Drive (``gdrive://...``) or mounted-Drive location a Trainer's ``output_dir`` is mirrored to.

    >>> link = DriveLink("out", "gdrive://root/runs/x")  # doctest: +SKIP
    >>> link.restore()   # before trainer.train: the newest durable checkpoint, as out/checkpoint-N
    >>> link.start(run_id); link.committed(step); link.close("10m")
    """

    def __init__(self, output_dir: str | os.PathLike[str], drive: str, cache_dir: str | None = None,
                 credentials: str | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.drive = drive
        location = open_run_location(drive, cache_dir=cache_dir or str(self.output_dir / VIEW),
                                     credentials=credentials)
        if location.remote is None:
            raise ValueError(f"drive={drive!r} is neither a gdrive:// URL nor a folder on a mounted Google Drive "
                             f"(/content/drive/...); give one of them, or leave drive out to keep checkpoints local")
        self.remote = location.remote
        self.run_dir = location.local_dir
        self.view = CheckpointManager(self.run_dir / "checkpoints")
        self.mirror: Mirror | None = None

    # -- keeping the view equal to the committed checkpoint-N folders --------------------------------
    def _sync(self) -> None:
        """The view holds exactly the committed (sizes checked) ``checkpoint-N`` folders."""
        self.view.cleanup_incomplete()
        committed = {info.step: info for info in (hf.check(s, p, deep=False) for s, p in hf.folders(self.output_dir))
                     if info.valid}
        in_view = {info.step: info for info in self.view.inspect(deep=False)}
        for step, info in in_view.items():
            if step not in committed or not info.valid or info.manifest != committed[step].manifest:
                self.view.delete(info.path)
        for step, info in committed.items():
            if step not in in_view or not in_view[step].valid or in_view[step].manifest != info.manifest:
                link_folder(info.path, self.view.root / fmt.step_dir_name(step), info.manifest)

    def restore(self) -> int | None:
        """Bring Drive's newest durable checkpoint back as ``checkpoint-N`` when it is newer than every local one
        (a fresh VM has none); returns its step. Raises RestoreFailed when Drive holds checkpoints of this run
        and none verifies."""
        self._sync()
        brought = restore_newest(self.remote, self.view, self.run_dir, log.info)
        if brought is None:
            return None
        source = self.view.root / fmt.step_dir_name(brought)
        target = self.output_dir / hf.folder_name(brought)
        link_folder(source, target, manifests.read(source).body)
        log.info(f"restored {target.name} from {self.remote.description}")
        return brought

    # -- mirroring -------------------------------------------------------------------------------------
    def start(self, run_id: str | None) -> None:
        """Start the background mirror (after :meth:`restore`); committed folders not yet on Drive go up."""
        self._sync()
        self.mirror = Mirror(self.view, self.remote, self.run_dir, log.info, run_id=run_id)
        if self.mirror.pending():
            self.mirror.submit(self.mirror.pending()[-1])

    def forget(self, step: int) -> None:
        """The Trainer is about to write ``checkpoint-N`` again: its linked copy in the view goes first."""
        path = self.view.root / fmt.step_dir_name(step)
        if os.path.lexists(path):
            self.view.delete(path)

    def committed(self, step: int, manifest: dict) -> None:
        self.forget(step)
        link_folder(self.output_dir / hf.folder_name(step), self.view.root / fmt.step_dir_name(step), manifest)
        if self.mirror is not None:
            self.mirror.submit(step)

    def pruned(self, steps: list[int]) -> None:
        for step in steps:
            self.forget(step)

    def close(self, flush_timeout_s: float) -> list[int]:
        """Wait up to ``flush_timeout_s`` for the uploads, stop the mirror; returns the steps still only local."""
        if self.mirror is None:
            return []
        pending = self.mirror.flush(flush_timeout_s)
        self.mirror.close(timeout=flush_timeout_s)
        where = self.remote.description
        if self.mirror.errors:
            log.error(f"{len(self.mirror.errors)} upload(s) to {where} failed ({self.mirror.errors[-1]})")
        if pending:
            log.warning(f"checkpoint(s) {', '.join(map(str, pending))} are committed in {self.output_dir} but not yet "
                        f"durable on {where}; keep this machine up and run again to upload them")
        elif self.mirror.durable:
            log.info(f"mirrored to {where}: newest durable checkpoint step {max(self.mirror.durable)}, "
                     f"{self.mirror.bytes / 1e6:.1f} MB uploaded")
        return pending

