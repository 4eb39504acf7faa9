"""Where a session's records go: metrics.jsonl (every rank keeps its counters; rank 0 writes), TensorBoard, the
trackers (W&B, MLflow, trackio), the progress bar and the console, and sessions.jsonl (how each session began and
ended)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...config import RunOptions
from ...reporting import mlflow, trackio
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
from ...reporting.tracking import StoreReporter
from ...reporting.wandb import WANDB_ID, WandbReporter, choose_id


def tracker_ids(manifest: Mapping[str, Any] | None, trackers: Mapping[str, Any], run_dir: Path) -> dict[str, str]:
    """The tracker run ids (names for trackio) this session records in each manifest: kept out of
    ``computation``, so they never block a resume; the checkpoint's also for a tracker that is off this session,
    so a later session continues the same run. A new MLflow run's id is added once it exists (:func:`started`)."""
    ids = {WANDB_ID: choose_id(manifest, trackers.get("wandb")), mlflow.MLFLOW_ID: mlflow.stored_id(manifest),
           trackio.TRACKIO_ID: trackio.choose_name(manifest, run_dir) if "trackio" in trackers
           else trackio.stored_name(manifest, trackio.TRACKIO_ID, "trackio")}
    return {key: value for key, value in ids.items() if value is not None}


def started(report: Reporters) -> dict[str, str]:
    """The run ids of the trackers that started (after ``session_start``): a new MLflow run's id is known now."""
    return {r.store.key: r.store.ident for r in report.reporters
            if isinstance(r, StoreReporter) and r.store.ident is not None}


def reporters(options: RunOptions, local: Path, main: bool, metrics: MetricsLog, sessions: SessionLog,
              trackers: Mapping[str, Any], ids: Mapping[str, str], settings: dict[str, Any], history: dict[str, Any],
              note: str | None) -> Reporters:
    """``trackers``: the trackers on ("wandb": "wandb" or a W&B run object, "mlflow", "trackio"); ``ids``: their run
    ids (:func:`tracker_ids`); ``history``: what sessions.jsonl records of this session besides its start and end
    (device, code and config digests, an AMP switch); ``note``: said once, at the start (a change of the dataset's
    size)."""
    chosen: list[Reporter] = [MetricsReporter(metrics)]
    if options.tensorboard and main:
        chosen.append(TensorBoardReporter(TensorBoardLog(local)))
    if main:
        wandb = trackers.get("wandb")
        if wandb is not None:
            chosen.append(WandbReporter(ids[WANDB_ID], options.wandb, local, local / METRICS, settings,
                                        run=None if wandb == "wandb" else wandb))
        if "mlflow" in trackers:
            store = mlflow.MlflowStore(ids.get(mlflow.MLFLOW_ID), options.mlflow, local, settings)
            chosen.append(StoreReporter(store, local / METRICS))
        if "trackio" in trackers:
            store = trackio.TrackioStore(ids[trackio.TRACKIO_ID], options.trackio, local, settings)
            chosen.append(StoreReporter(store, local / METRICS))
    if options.progress and not options.quiet and main:
        chosen.append(ProgressReporter())
    chosen.append(ConsoleReporter())
    chosen.append(HistoryReporter(sessions, note, history))
    return Reporters(chosen)
