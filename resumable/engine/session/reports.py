"""Where a session's records go: metrics.jsonl (every rank keeps its counters; rank 0 writes), TensorBoard, W&B, the
progress bar and the console, and sessions.jsonl (how each session began and ended)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...config import RunOptions
from ...reporting.history import SessionLog
from ...reporting.metrics import METRICS, MetricsLog
from ...reporting.reporters import (
    ConsoleReporter,
    HistoryReporter,
    MetricsReporter,
    ProgressReporter,
    Reporter,
    Reporters,
    TensorBoardReporter,
)
from ...reporting.tensorboard import TensorBoardLog
from ...reporting.wandb import WandbReporter


def reporters(options: RunOptions, local: Path, main: bool, metrics: MetricsLog, sessions: SessionLog,
              tracker: Any, wandb_id: str | None, settings: dict[str, Any], history: dict[str, Any],
              note: str | None) -> Reporters:
    """``tracker``: None, "wandb" or a W&B run object (reporting/wandb.py); ``history``: what sessions.jsonl records
    of this session besides its start and end (device, code and config digests, an AMP switch); ``note``: said
    once, at the start (a change of the dataset's size)."""
    chosen: list[Reporter] = [MetricsReporter(metrics)]
    if options.tensorboard and main:
        chosen.append(TensorBoardReporter(TensorBoardLog(local)))
    if tracker is not None and main:
        chosen.append(WandbReporter(wandb_id, options.wandb, local, local / METRICS, settings,
                                    run=None if tracker == "wandb" else tracker))
    if options.progress and not options.quiet and main:
        chosen.append(ProgressReporter())
    chosen.append(ConsoleReporter())
    chosen.append(HistoryReporter(sessions, note, history))
    return Reporters(chosen)
