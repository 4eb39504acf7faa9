"""Mirroring a Trainer's committed ``checkpoint-N`` folders to Google Drive, and bringing them back on a fresh VM.

The output dir is a CheckpointManager with the Trainer's layout (hf_checkpoints.py), so resumable's Mirror
(storage/tiered.py) uploads its folders as they are, in the background, manifest last, to
``<drive>/checkpoints/checkpoint-N``, and prunes Drive as the output dir is pruned; ``resumable inspect
gdrive://...`` reads them. On a fresh VM :meth:`DriveLink.restore` brings the newest durable one back into the output
dir (verified sha256 by sha256, manifest last) before the Trainer looks for a checkpoint. The local cache of a
``gdrive://`` location only keeps the Drive API's unfinished upload sessions (``OUTPUT_DIR/.resumable/`` unless
``cache_dir`` says otherwise). The Lightning callback uses the same link on its ``step-N`` folders (``layout=STEPS``).
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import log
from ..checkpoint import CheckpointManager
from ..storage import open_run_location
from ..storage.restore import restore_newest
from ..storage.tiered import Mirror
from . import hf_checkpoints as hf

CACHE = ".resumable"  # in OUTPUT_DIR; the Trainer only looks at checkpoint-* entries


class DriveLink:
    """The Drive (``gdrive://...``) or mounted-Drive location a Trainer's ``output_dir`` is mirrored to (``layout``: how
    its checkpoint folders are named; the Lightning callback's are ``step-N``).

    >>> link = DriveLink("out", "gdrive://root/runs/x")  # doctest: +SKIP
    >>> link.restore()   # before trainer.train: the newest durable checkpoint, as out/checkpoint-N
    >>> link.start(run_id); link.committed(step); link.close(600)
    """

    def __init__(self, output_dir: str | os.PathLike[str], drive: str, cache_dir: str | None = None,
                 credentials: str | None = None, checkpoints: CheckpointManager | None = None) -> None:
        """``checkpoints``: the folders mirrored (default: ``output_dir``'s ``checkpoint-N``; the Accelerate
        integration passes its own ``checkpoint_N`` store)."""
        self.output_dir = Path(output_dir)
        location = open_run_location(drive, cache_dir=cache_dir or str(self.output_dir / CACHE),
                                     credentials=credentials)
        if location.remote is None:
            raise ValueError(f"drive={drive!r} is neither a gdrive:// URL nor a folder on a mounted Google Drive "
                             f"(/content/drive/...); give one of them, or leave drive out to keep checkpoints local")
        self.remote = location.remote
        self.checkpoints = checkpoints if checkpoints is not None else hf.checkpoints(self.output_dir)
        self.mirror: Mirror | None = None

    def restore(self) -> int | None:
        """Bring Drive's newest durable checkpoint back as ``checkpoint-N`` when it is newer than every local one
        (a fresh VM has none); returns its step. Raises RestoreFailed when Drive holds checkpoints of this run
        and none verifies."""
        brought = restore_newest(self.remote, self.checkpoints, None, log.info)
        if brought is not None:
            log.info(f"restored {self.checkpoints.folder(brought).name} from {self.remote.description}")
        return brought

    def start(self, run_id: str | None) -> None:
        """Start the background mirror (after :meth:`restore`); committed folders not yet on Drive go up."""
        self.mirror = Mirror(self.checkpoints, self.remote, None, log.info, run_id=run_id)
        if self.mirror.pending():
            self.mirror.submit(self.mirror.pending()[-1])

    def committed(self, step: int) -> None:
        if self.mirror is not None:
            self.mirror.submit(step)

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
