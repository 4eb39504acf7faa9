"""MLflow: the records of ``metrics.jsonl`` in ONE MLflow run across every session (extra ``mlflow``).

The MLflow run id is recorded in each checkpoint's manifest (``mlflow_run_id``), and each session that resumes
continues that run (``MlflowClient``; no global active run, so a notebook's own ``mlflow.start_run`` is left
alone). The store is ``MLFLOW_TRACKING_URI`` when set, else the file store ``RUN_DIR/mlruns`` (offline, and on
Drive when the run dir is). MLflow 3.18 refuses its file store unless ``MLFLOW_ALLOW_FILE_STORE=true`` (it is in
maintenance mode; the database store needs SQLAlchemy, which mlflow-skinny lacks): it is set for this process
when the store is a file store.

Each step once (mlflow#4248: a restarted job logs its steps again): on a file store, each metric's file
(``<experiment>/<run>/metrics/<key>``, lines ``timestamp value step``) is rewritten at each session start to
hold only its well-formed lines up to the resumed step, the first per step (a torn last line, from a kill in the
middle of an append, goes too). Then :class:`~resumable.reporting.tracking.StoreReporter` sends what the store
lacks up to that step from ``metrics.jsonl`` and the rest as it is trained. Another store (a tracking server)
cannot delete a metric's points: the steps it has are not sent again (reporting/tracking.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from .. import log
from ..atomic import replace_with
from .tracking import require, stored_name

MLFLOW_ID = "mlflow_run_id"  # the manifest key
_KIND = "MLflow"


def require_mlflow() -> None:
    require("mlflow", "mlflow", "MLflow tracking (--mlflow / tracker='mlflow')")


def stored_id(manifest: Mapping[str, Any] | None) -> str | None:
    return stored_name(manifest, MLFLOW_ID, _KIND)


def tracking_uri(run_dir: Path) -> str:
    """``MLFLOW_TRACKING_URI``, else the file store under the run dir."""
    return os.environ.get("MLFLOW_TRACKING_URI") or (Path(run_dir).absolute() / "mlruns").as_uri()


def file_root(uri: str) -> Path | None:
    """The folder of a file store (``file:`` URI or a plain path), None for other stores."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return Path(uri)
    return None


def _points(data: bytes, after: int) -> list[bytes]:
    """The well-formed lines ``timestamp value step`` of a metric file with a step up to ``after``, the first of
    each step (anything else, a torn tail included, is dropped)."""
    kept, seen = [], set()
    for line in data.split(b"\n"):
        parts = line.split()
        if len(parts) != 3 or not line.strip()[-1:].isdigit():
            continue
        try:
            int(parts[0]), float(parts[1])
            step = int(parts[2])
        except ValueError:
            continue
        if step <= after and step not in seen:
            seen.add(step)
            kept.append(line.strip() + b"\n")
    return kept


class MlflowStore:
    """One MLflow run through ``MlflowClient`` (see the module docstring)."""

    name = _KIND
    key = MLFLOW_ID

    def __init__(self, run_id: str | None, experiment: str | None, run_dir: Path,
                 config: Mapping[str, Any] | None = None) -> None:
        self.run_id, self.experiment, self.run_dir = run_id, experiment, Path(run_dir)
        self.config = dict(config or {})
        self.uri = tracking_uri(self.run_dir)
        self.root = file_root(self.uri)
        self._client: Any = None

    @property
    def ident(self) -> str | None:
        """The MLflow run id: the checkpoint's, or the new run's once :meth:`open` created it."""
        return self.run_id

    def open(self) -> None:
        if self.root is not None:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # offline, without SQLAlchemy
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        self._client = client = MlflowClient(tracking_uri=self.uri)
        if self.run_id is not None:
            try:
                client.update_run(self.run_id, status="RUNNING")
                return
            except MlflowException as e:
                log.warning(f"the MLflow run {self.run_id} the checkpoint recorded is not in {self.uri} ({e}); "
                            f"a new MLflow run is started")
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        found = client.get_experiment_by_name(name)
        experiment = found.experiment_id if found is not None else client.create_experiment(name)
        run = client.create_run(experiment, run_name=self.run_dir.name or None)
        self.run_id = run.info.run_id
        params = {k: str(v)[:6000] for k, v in self.config.items()}
        if params:
            client.log_batch(self.run_id, params=[_param(k, v) for k, v in params.items()])

    def _metric_files(self) -> list[Path]:
        assert self.root is not None and self.run_id is not None
        found = []
        for folder in self.root.glob(f"*/{self.run_id}/metrics"):
            for path in folder.rglob("*"):
                if not path.is_symlink() and path.is_file():
                    found.append(path)
        return found

    def truncate(self, after: int) -> bool:
        if self.root is None:
            return False
        for path in self._metric_files():
            data = path.read_bytes()
            kept = b"".join(_points(data, after))
            if kept != data:
                replace_with(path, kept)
        return True

    def history(self) -> dict[int, dict[str, Any]]:
        client, rows = self._client, {}
        for key in client.get_run(self.run_id).data.metrics:
            for metric in client.get_metric_history(self.run_id, key):
                rows.setdefault(metric.step, {})[key] = metric.value
        return rows

    def log(self, step: int, row: dict[str, float | int]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in row.items()])

    def close(self, ended: str) -> None:
        self._client.set_terminated(self.run_id, "FINISHED" if ended == "finished" else "KILLED")


def _param(key: str, value: str) -> Any:
    from mlflow.entities import Param

    return Param(key, value)
