"""MLflow and trackio across sessions, offline (MLflow's file store, trackio's SQLite): one tracker run for the whole
training run, and each step in the tracker once with the values of the run that continued — read back from the
tracker's own store — after SIGKILLs (one inside a save) and after a resume from an older step that trains the later
steps to other values.

Kill points are random but reproducible: the seed is printed, and RESUMABLE_KILL_SEED replays it.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import env, final_fingerprint, records, train_script
from tracker_train import main

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.checkpoint import format as fmt
from resumable.errors import ResumableError
from resumable.faults import Faults
from resumable.reporting.metrics import TIMING_FIELDS, read_records

SCRIPT = Path(__file__).parent / "tracker_train.py"
TOTAL = 24  # 64 samples, batch 8, 3 epochs; evaluations at every 3rd step and epoch ends, checkpoints after each


def _train(run_dir: Path, tracker: str, *args: str, faults: Faults | None = None) -> subprocess.CompletedProcess:
    """In this process without faults (mlflow is imported once: ~3 s a process on 2 busy cores); trackio always as its
    own process (it reads TRACKIO_DIR once, when imported, and each test has its own)."""
    if faults is None and tracker != "trackio":
        return train_script(SCRIPT, main, [str(run_dir), "--tracker", tracker, *args])
    extra = faults.to_env() if faults is not None else {}
    # the trackers' own variables unset: their stores default to the run dir
    base = env(**extra)
    return subprocess.run([sys.executable, str(SCRIPT), str(run_dir), "--tracker", tracker, *args],
                          capture_output=True, text=True, timeout=300, env=base, stdin=subprocess.DEVNULL)


def _manifest_ids(run_dir: Path, key: str) -> set:
    return {json.loads((p / fmt.MANIFEST).read_text()).get(key)
            for _, p in CheckpointManager(checkpoints_dir(run_dir)).step_dirs() if (p / fmt.MANIFEST).exists()}


def _stored(run_dir: Path, tracker: str) -> list[tuple[str, int, dict]]:
    """(run, step, values) of every point the tracker's store holds, as its own files / API give them back."""
    if tracker == "trackio":  # trackio's SQLite database, read as it is (its module reads TRACKIO_DIR once)
        with sqlite3.connect(run_dir / "trackio" / "tests.db") as conn:
            rows = conn.execute("SELECT run_name, step, metrics FROM metrics ORDER BY id").fetchall()
        return [(name, step, {k[2:] if k.startswith("__") else k: v for k, v in json.loads(data).items()})
                for name, step, data in rows]
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    points = []
    for experiment in client.search_experiments():
        for found in client.search_runs([experiment.experiment_id]):
            run_id = found.info.run_id
            for key in found.data.metrics:
                points += [(run_id, m.step, {key: m.value}) for m in client.get_metric_history(run_id, key)]
    return points


def _assert_once_and_equal(run_dir: Path, tracker: str) -> None:
    """ONE tracker run, the one every manifest names; each (metric, step) once; the values of metrics.jsonl."""
    points = _stored(run_dir, tracker)
    runs = {run for run, _, _ in points}
    key = "trackio_run" if tracker == "trackio" else "mlflow_run_id"
    assert len(runs) == 1 and runs == _manifest_ids(run_dir, key), (runs, _manifest_ids(run_dir, key))
    seen: dict[int, dict] = {}
    for _, step, values in points:
        row = seen.setdefault(step, {})
        assert not set(values) & set(row), f"step {step} twice in {tracker}: {sorted(set(values) & set(row))}"
        row.update(values)
    if tracker == "trackio":
        steps = [step for _, step, _ in points]
        assert steps == sorted(set(steps)), f"one trackio row per step, in order: {steps}"
    expected: dict[int, dict] = {}
    for record in read_records(run_dir / "metrics.jsonl"):
        expected.setdefault(record["step"], {}).update({k: v for k, v in record.items() if k != "step"})

    def plain(rows: dict[int, dict]) -> dict[int, dict]:
        return {s: {k: float(v) for k, v in r.items() if k not in TIMING_FIELDS} for s, r in rows.items()}

    assert sorted(seen) == list(range(1, TOTAL + 1))
    assert plain(seen) == plain(expected), f"{tracker}'s values differ from metrics.jsonl's"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (trackers do not change training: one reference for both)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    straight = _train(run_dir, "none")
    assert straight.returncode == 0, straight.stderr
    return run_dir


@pytest.fixture(autouse=True)
def _stores_in_the_run_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "TRACKIO_DIR", "TRACKIO_PROJECT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("tracker", ["mlflow", "trackio"])
def test_two_sigkills_one_tracker_run_each_step_once(tmp_path: Path, tracker: str, reference: Path) -> None:
    pytest.importorskip(tracker)
    seed = int(os.environ.get("RESUMABLE_KILL_SEED", random.SystemRandom().randrange(2**31)))
    print(f"kill seed {seed} (replay with RESUMABLE_KILL_SEED={seed})")
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    first, second = rng.randint(5, 11), rng.choice((12, 15, 16, 18, 20))  # a step; a save (checkpoints at both)
    for faults in (Faults(kill_at_step=first), Faults(kill_in_save_at_step=second)):
        killed = _train(run_dir, tracker, faults=faults)
        assert killed.returncode == -9, f"{faults}: {killed.returncode} {killed.stderr[-2000:]}"
    final = _train(run_dir, tracker)
    assert final.returncode == 0, final.stderr
    assert "stopped recording" not in final.stderr, final.stderr
    print(f"killed at step {first}, in the save of step {second}")
    assert final_fingerprint(run_dir) == final_fingerprint(reference), "the resumed weights equal the straight run's"
    assert records(run_dir) == records(reference), "the resumed run logged the straight run's metrics"
    _assert_once_and_equal(run_dir, tracker)


@pytest.mark.parametrize("tracker", ["mlflow", "trackio"])
def test_a_resume_from_an_older_step_replaces_the_later_steps(tmp_path: Path, tracker: str) -> None:
    """The tracker has steps 1-10 of a finished session; the run resumes from step 8 (the newer checkpoints gone, as
    after a fallback) and trains 9 and 10 to other values (the loss doubled): the tracker ends with this session's
    values of 9 and 10, each once, not the earlier session's."""
    pytest.importorskip(tracker)
    run_dir = tmp_path / "run"
    first = _train(run_dir, tracker, "--max-steps", "10")
    assert first.returncode == 0, first.stderr
    earlier = {step: values for _, step, values in _stored(run_dir, tracker) if "loss" in values}
    assert sorted(earlier) == list(range(1, 11)), "the first session's steps are all in the tracker"
    manager = CheckpointManager(checkpoints_dir(run_dir))
    for step, path in manager.step_dirs():
        if step > 8:
            manager.delete(path)
    assert manager.latest_valid()[0].step == 8
    second = _train(run_dir, tracker, "--loss-scale", "2")
    assert second.returncode == 0, second.stderr
    assert "stopped recording" not in second.stderr, second.stderr
    _assert_once_and_equal(run_dir, tracker)
    now = {step: values for _, step, values in _stored(run_dir, tracker) if "loss" in values}
    assert now[8]["loss"] == earlier[8]["loss"] and now[9]["loss"] != earlier[9]["loss"]


@pytest.mark.parametrize("tracker", ["mlflow", "trackio"])
def test_a_missing_tracker_package_names_the_pip_command(tracker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from resumable.config import RunOptions
    from resumable.engine.run import trackers_of

    monkeypatch.setitem(sys.modules, tracker, None)
    for given, options in ((tracker, RunOptions()), (None, RunOptions(**{tracker: "x"}))):
        with pytest.raises(ResumableError, match=rf"pip install 'resumable\[{tracker}\]'") as caught:
            trackers_of(given, options)
        assert caught.value.exit_code == 2


def test_trackers_are_chosen_by_name_or_by_reporting_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from resumable.config import RunOptions
    from resumable.engine.run import trackers_of

    assert trackers_of(None, RunOptions()) == {}
    assert trackers_of("mlflow", RunOptions(trackio="p")) == {"mlflow": "mlflow", "trackio": "trackio"}
    with pytest.raises(ValueError, match="tracker='trackio' or tracker='mlflow'"):
        trackers_of(type("Run", (), {"__module__": "trackio.run", "log": print, "id": "x"})(), RunOptions())
    with pytest.raises(ValueError, match="must be 'wandb', 'mlflow', 'trackio'"):
        trackers_of("tensorboard", RunOptions())
