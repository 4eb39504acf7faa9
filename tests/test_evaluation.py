"""Evaluation on any schedule and the best checkpoint by any metric (engine/loop/evaluation.py): an evaluation every N
steps leaves training exactly as it would be without one; runs killed with SIGKILL (at exact steps, inside the save
that follows an evaluation, and at random moments under chaos) end with the uninterrupted run's state and records;
the lowest ``val_loss`` checkpoint is kept through retention and shown by ``resumable inspect``."""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import env, final_fingerprint, inspect_json, records, run

from resumable import Evaluation
from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.checkpoint.retention import Best, Candidate, best_entry, rule_of, steps_to_prune
from resumable.engine.loop.evaluation import Evaluator
from resumable.engine.state.train_state import TrainState
from resumable.faults import Faults

sys.path.insert(0, str(Path(__file__).parent))
import eval_train  # noqa: E402 - the script beside this file

SCRIPT = Path(eval_train.__file__)


def _train(run_dir: Path, every: int = 5, faults: Faults | None = None) -> subprocess.CompletedProcess:
    args = [str(run_dir), str(every)]
    if faults is None:  # in this process (fast); a session that is killed runs as its own process
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = eval_train.main(args)
        return subprocess.CompletedProcess(args, code, "", stderr.getvalue())
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env=env(**faults.to_env()), stdin=subprocess.DEVNULL)


def _kept(run_dir: Path) -> list[int]:
    return [i.step for i in CheckpointManager(checkpoints_dir(run_dir)).inspect(deep=False) if i.valid]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("evaluation") / "reference"
    assert _train(run_dir).returncode == 0
    return run_dir


# -- the schedule and the best, without processes ------------------------------------------------------------------

def test_the_schedule_evaluates_every_n_steps_and_at_epoch_ends() -> None:
    model = torch.nn.Linear(1, 1)
    both = Evaluator(dict, model, every_steps=5, at_epoch_end=True)
    assert [s for s in range(1, 13) if both.due(s, epoch_end=s == 12)] == [5, 10, 12]
    steps_only = Evaluator(dict, model, every_steps=5, at_epoch_end=False)
    assert [s for s in range(1, 13) if steps_only.due(s, epoch_end=s == 12)] == [5, 10]
    assert not Evaluator(None, model).due(12, epoch_end=True)


def test_an_evaluation_leaves_every_rng_stream_and_module_mode_as_it_found_them() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    model.train()
    model[1].eval()  # a mixed state comes back as it was, too

    def disturbing() -> dict[str, float]:
        model.eval()
        return {"val_loss": torch.rand(()).item() + random.random() + float(np.random.rand())}

    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    metrics = Evaluator(disturbing, model)()
    assert set(metrics) == {"val_loss"} and isinstance(metrics["val_loss"], float)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()
    assert model.training and model[0].training and not model[1].training


def test_the_best_follows_the_monitored_metric_and_its_direction(capsys: pytest.CaptureFixture[str]) -> None:
    lowest = Evaluator(dict, torch.nn.Linear(1, 1), best=Best("val_loss", "min"))
    state = TrainState()
    for step, loss in [(5, 0.9), (10, 0.7), (15, 0.8)]:
        state.step = step
        lowest.record_best(state, {"val_loss": loss})
    assert (state.best_step, state.best_value, state.best_metric) == (10, 0.7, "val_loss:min")
    # a resume that monitors another metric starts its best afresh
    highest = Evaluator(dict, torch.nn.Linear(1, 1), best=Best("val_acc", "max"))
    state.step = 20
    highest.record_best(state, {"val_loss": 0.1, "val_acc": 0.5})
    assert (state.best_step, state.best_value, state.best_metric) == (20, 0.5, "val_acc:max")
    missing = Evaluator(dict, torch.nn.Linear(1, 1), best=Best("bleu", "max"))
    missing.record_best(state, {"val_loss": 0.1})
    assert "without 'bleu'" in capsys.readouterr().err


def test_retention_keeps_the_best_by_the_chosen_metric() -> None:
    candidates = [Candidate(5, 0.4), Candidate(10, 0.2), Candidate(15, None), Candidate(20, 0.3), Candidate(25)]
    assert steps_to_prune(candidates, keep=1, keep_best=True, best=Best("val_loss", "min")) == [5, 15, 20]
    assert steps_to_prune(candidates, keep=1, keep_best=True, best=Best("test_acc", "max")) == [10, 15, 20]
    assert rule_of({"best": {"monitor": "val_loss", "mode": "min"}}) == Best("val_loss", "min")
    assert rule_of({"best": {"monitor": "", "mode": "up"}}) == Best() and rule_of(None) == Best()
    entries = [{"step": 5, "valid": True, "metrics": {"val_loss": 0.4}},
               {"step": 10, "valid": False, "metrics": {"val_loss": 0.1}},
               {"step": 20, "valid": True, "metrics": {}, "best": {"monitor": "val_loss", "mode": "min"}}]
    rule, best = best_entry(entries)
    assert rule == Best("val_loss", "min") and best is entries[0]  # the invalid one never counts


@pytest.mark.parametrize(("options", "message"), [
    ({"every_steps": 0}, "every_steps=0"), ({"every_steps": None, "at_epoch_end": False}, "never evaluate"),
    ({"mode": "lower"}, r"mode='lower'\) must be 'max'"), ({"monitor": ""}, "monitor=''\\)")])
def test_an_evaluation_policy_that_cannot_work_is_refused_with_the_fix(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Evaluation(dict, **options)
    with pytest.raises(ValueError, match="must be a function"):
        Evaluation("evaluate")


# -- whole runs ------------------------------------------------------------------------------------------------------

def test_evaluating_every_5_steps_trains_exactly_as_without_evaluation(reference: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    assert _train(plain, every=0).returncode == 0
    trained = [CheckpointManager(checkpoints_dir(d)).latest_valid()[0].path for d in (reference, plain)]
    weights = [_model_tensors(p) for p in trained]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    evaluated = [r["step"] for r in records(reference) if "val_loss" in r]
    assert evaluated == [5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60]
    assert sum("train_loss" in r for r in records(reference)) == 2  # the epoch records carry it (steps 30, 60)


def _model_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint: the model, the optimizer and the RNG streams."""
    from safetensors.torch import load_file
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(step_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    assert any(k.startswith("/model/") for k in tensors) and "/rng/torch_cpu" in tensors, sorted(tensors)
    return tensors


def test_the_lowest_val_loss_checkpoint_is_kept_and_inspect_names_it(reference: Path) -> None:
    assert _kept(reference) == [5, 60]  # keep=1 and the best: step 5, where val_loss was lowest
    listing = inspect_json(reference)
    assert listing["best"]["monitor"] == "val_loss" and listing["best"]["mode"] == "min"
    assert listing["best"]["step"] == 5
    shown = run(["inspect", str(reference)], name="resumable")
    line = next(line for line in shown.stdout.splitlines() if line.split()[:1] == ["5"])
    assert "<- best (val_loss" in line and "lowest" in line


def test_kills_around_mid_epoch_evaluations_end_as_the_uninterrupted_run(reference: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    killed = _train(run_dir, faults=Faults(kill_at_step=7))  # after step 6's checkpoint and step 5's evaluation
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    killed = _train(run_dir, faults=Faults(kill_in_save_at_step=10))  # between step 10's evaluation and its commit
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # saves are in the background: step 6's may have been in flight at the kill
    assert re.search(r"resuming from step [56] ", killed.stderr) and "step 10 (epoch 1)  val_loss" in killed.stderr
    killed = _train(run_dir, faults=Faults(kill_at_step=33))  # in epoch 2, after step 30's evaluation and save
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert "resuming from step 9 " in killed.stderr  # step 10's save never committed (step 9's did, before it)
    done = _train(run_dir)
    assert done.returncode == 0 and re.search(r"resuming from step (27|30) ", done.stderr), done.stderr[-2000:]
    assert final_fingerprint(run_dir) == final_fingerprint(reference)
    from resumable.reporting.metrics import without_timing
    assert without_timing(records(run_dir)) == without_timing(records(reference))  # each evaluation once, same values
    assert _kept(run_dir) == [5, 60]  # the best survived every retention pass since step 5


def test_chaos_kills_at_random_moments_and_inside_saves_end_identical(tmp_path: Path) -> None:
    result = run(["chaos", "--target", f"{SCRIPT}:main", "--warm", "--kills", "3", "--seed", "5", "--every", "0.3s",
                  "--workdir", str(tmp_path), "--json", "--", "{run_dir}", "5"], name="resumable", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["verdict"] == "IDENTICAL", report["difference"]
    assert report["kills"] and report["kills"][0]["mid_save"]
