"""A Lightning ``CheckpointIO`` that commits each checkpoint with resumable's manifest, and the newest valid one.

Lightning writes a checkpoint as one file, with no marker of completion: a kill mid-save leaves a truncated
``.ckpt`` that looks like a checkpoint, and ``ckpt_path="last"`` picks it. Here each checkpoint the
:class:`~resumable.integrations.lightning.ResumableCallback` asks for goes into its own folder,
``DIRPATH/step-000000012/lightning.ckpt`` (checkpoint/layout.py's ``step-N`` folders, as ``resumable-train``'s), and
:class:`CommitCheckpointIO` commits that folder once the file is written: the file hashed and fsynced, then
``manifest.json`` last (``CheckpointManager.adopt``, the same commit as the Hugging Face Trainer's). A save to any other
path (the user's own ``ModelCheckpoint``) goes to the wrapped ``CheckpointIO`` unchanged. :func:`latest_valid` is the
``ckpt_path`` to resume from: the newest folder whose manifest reads and whose file verifies; newer ones are skipped
with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from .. import log
from ..checkpoint import CheckpointManager
from ..checkpoint.layout import STEPS
from ..errors import NothingToResume
from ..faults import Faults, installed

FILE = "lightning.ckpt"  # the checkpoint file inside each step folder


def checkpoints(dirpath: str | os.PathLike[str], faults: Faults | None = None) -> CheckpointManager:
    """The ``step-N`` folders of ``dirpath``."""
    return CheckpointManager(Path(dirpath), faults=faults or installed(), layout=STEPS)


def checkpoint_file(dirpath: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint of ``step`` is written: its own step folder."""
    return Path(dirpath) / STEPS.name(step) / FILE


def latest_valid(dirpath: str | os.PathLike[str]) -> str | None:
    """The ``ckpt_path`` for ``trainer.fit``: the file of the newest committed step folder of ``dirpath`` whose every
    file verifies, or None (a fresh start). Newer folders are skipped with the reason ("skipping step-000000015
    (...): no manifest.json (the save did not finish)"). Raises NothingToResume when there are committed checkpoints
    and none verifies: starting over would train over them."""
    store = checkpoints(dirpath)
    chosen, skipped = store.latest_valid()
    for info in skipped:
        log.warning(f"skipping {info.path.name} ({info.path}): {info.reason}")
    if chosen is not None:
        if FILE not in (chosen.manifest or {}).get("files", {}):
            raise NothingToResume(f"{chosen.path} is a committed checkpoint without {FILE}: it was not written by "
                                  f"the Lightning callback; give the callback a folder of its own")
        log.info(f"resuming from {chosen.path.name} ({chosen.path / FILE})")
        return str(chosen.path / FILE)
    committed = [info.path.name for info in store.inspect(deep=False) if info.committed]
    if committed:
        raise NothingToResume(f"{dirpath} has committed checkpoints ({', '.join(committed)}) but none verifies; "
                              f"refusing to start over on top of them. Delete them or use another dirpath")
    return None


class CommitCheckpointIO(CheckpointIO):
    """Writes ``DIRPATH/step-N/lightning.ckpt`` through ``wrapped`` (Lightning's TorchCheckpointIO by default),
    then commits the folder: its old manifest goes before the file is replaced, the new one comes last. Other
    paths go to ``wrapped`` as they are. ``remove_checkpoint`` of a step folder's file deletes the folder,
    manifest first. ``meta``: extra manifest fields for the next commit (the callback's run id)."""

    def __init__(self, dirpath: str | os.PathLike[str], wrapped: CheckpointIO | None = None,
                 faults: Faults | None = None) -> None:
        self.dirpath = Path(dirpath)
        self.wrapped = wrapped or TorchCheckpointIO()
        self.store = checkpoints(self.dirpath, faults)
        self.meta: dict[str, Any] = {}
        self.committed: list[int] = []  # steps committed by this object, in order

    def step_of(self, path: str | os.PathLike[str]) -> int | None:
        """The step of ``DIRPATH/step-N/lightning.ckpt``; None for any other path."""
        path = Path(path)
        if path.name != FILE or path.parent.parent.resolve() != self.dirpath.resolve():
            return None
        return STEPS.parse(path.parent.name)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        step = self.step_of(path)
        if step is None:
            self.wrapped.save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        self.store.begin(step)  # the folder, without the manifest an older save of this step left there
        self.wrapped.save_checkpoint(checkpoint, path, storage_options=storage_options)
        self.store.adopt(step, {**self.meta, "source": "lightning.Trainer",
                                "lightning_version": lightning.__version__})
        self.committed.append(step)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """A step folder's checkpoint is always loaded with ``weights_only=True``: tensors and plain containers, never
        arbitrary pickled objects (Lightning passes None, which older torch reads as False). Other paths load as
        Lightning asks."""
        if self.step_of(path) is not None:
            weights_only = True
        return self.wrapped.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        step = self.step_of(path)
        if step is None:
            self.wrapped.remove_checkpoint(path)
        else:
            self.store.delete(self.store.folder(step))

    def teardown(self) -> None:
        self.wrapped.teardown()
