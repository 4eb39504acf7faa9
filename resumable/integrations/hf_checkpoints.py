"""A Trainer's ``OUTPUT_DIR`` as a checkpoint store: its ``checkpoint-N`` folders under resumable's commit protocol.

The Trainer writes ``OUTPUT_DIR/checkpoint-N/`` (model, optimizer, scheduler, RNG states, trainer_state.json) with
plain writes and no marker of completion, so a kill mid-save leaves a folder that looks like a checkpoint. The
folders are kept by resumable's own CheckpointManager with the Trainer's folder layout (checkpoint/layout.py):
``adopt`` commits what the Trainer wrote (manifest last), ``latest_valid`` skips what does not verify, ``prune``
applies ``save_total_limit`` only after a commit, and the Drive mirror (hf_drive.py) uploads and restores the same
folders. No transformers import here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .. import log
from ..checkpoint import CheckpointInfo, CheckpointManager
from ..checkpoint.layout import TRAINER
from ..storage.base import run_of


def checkpoints(output_dir: str | os.PathLike[str]) -> CheckpointManager:
    """The ``checkpoint-N`` folders of ``output_dir``."""
    return CheckpointManager(Path(output_dir), layout=TRAINER)


def newest_valid(store: CheckpointManager, say: Callable[[str], None] | None = None) -> CheckpointInfo | None:
    """The newest fully verified ``checkpoint-N``; each newer folder skipped is said with its reason."""
    chosen, skipped = store.latest_valid()
    for info in skipped:
        (say or log.warning)(f"skipping {info.path.name} ({info.path}): {info.reason}")
    return chosen


def newest_run_id(store: CheckpointManager) -> str | None:
    """The run id of the newest committed checkpoint whose files have their sizes (no hashing: at every start)."""
    valid = [info for info in store.inspect(deep=False) if info.valid]
    return run_of(valid[-1].manifest) if valid else None
