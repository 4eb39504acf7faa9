"""TensorBoard event files under ``RUN_DIR/tensorboard`` (optional extra ``tensorboard``).

Every metrics record is mirrored as scalars (``train/loss``, ``train/lr``, ``eval/test_acc``...) at its
step. A resumed session opens the writer with ``purge_step = resumed step + 1``: TensorBoard then drops the
events a killed session wrote after that checkpoint, which the resumed run writes again, so the curves
have no duplicates. Events are flushed before each checkpoint commits, like the metrics file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ResumableError

TENSORBOARD_DIR = "tensorboard"  # RUN_DIR/tensorboard; mirrored to Drive with the run's logs

# Record keys that are not scalars to plot.
_SKIP = frozenset({"step", "epoch", "time"})
_TRAINING = frozenset({"loss", "lr", "samples_per_s"})


class TensorBoardLog:
    def __init__(self, run_dir: Path) -> None:
        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self._writer: Any = None

    def open(self, resumed_from: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's writer needs the tensorboard package
            raise ResumableError("--tensorboard needs the tensorboard package: pip install 'resumable[tensorboard]' "
                                 "(or pip install tensorboard)") from e
        purge = resumed_from + 1 if resumed_from is not None else None
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge, flush_secs=30)

    def record(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if self._writer is None or not isinstance(step, int):
            return
        for key, value in record.items():
            if key in _SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            group = "train" if key in _TRAINING or key == "train_loss" else "eval"
            if key == "elapsed_s":
                group = "time"
            self._writer.add_scalar(f"{group}/{key}", value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
