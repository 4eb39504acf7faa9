"""How a checkpoint folder is named for its step: resumable's ``step-000001234``, the Trainer's ``checkpoint-N`` or
Accelerate's ``checkpoint_N``.

A :class:`Layout` is the only place a folder name is made or read. The CheckpointManager takes one (its root holds
folders of that layout), the Mirror and a restore from Drive use the manager's, so a Trainer's ``checkpoint-N``
folders are committed, pruned, mirrored and brought back exactly as resumable's own, under their own names, locally
and on Drive. Anything that only needs the step of a folder of either kind (a manifest's checks, ``inspect`` of a
remote run folder) reads it with :func:`step_of`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..atomic import TMP_MARK

MAX_DIGITS = 19  # a 64-bit step


@dataclass(frozen=True)
class Layout:
    """Folders named ``<prefix><sep><step>``, the step zero-padded to ``width`` digits (0: not padded)."""

    prefix: str
    width: int = 0
    sep: str = "-"

    def name(self, step: int) -> str:
        return f"{self.prefix}{self.sep}{step:0{self.width}d}"

    def parse(self, name: str) -> int | None:
        """The step of a folder name of this layout, or None for anything else (a temp name, non-ASCII digits:
        str.isdigit accepts "١٢٣" or "²", which int() reads or rejects)."""
        head = f"{self.prefix}{self.sep}"
        if not name.startswith(head) or TMP_MARK in name:
            return None
        digits = name[len(head):]
        return int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= MAX_DIGITS else None


STEPS = Layout("step", 9)  # RUN_DIR/checkpoints/step-000001234 (resumable-train, Run)
TRAINER = Layout("checkpoint")  # OUTPUT_DIR/checkpoint-1234 (transformers.trainer_utils.PREFIX_CHECKPOINT_DIR)
ACCELERATE = Layout("checkpoint", sep="_")  # PROJECT_DIR/checkpoints/checkpoint_1234 (Accelerate's automatic naming)
LAYOUTS = (STEPS, TRAINER, ACCELERATE)


def step_of(name: str) -> int | None:
    """The step of a checkpoint folder of any layout, or None."""
    for layout in LAYOUTS:
        step = layout.parse(name)
        if step is not None:
            return step
    return None
