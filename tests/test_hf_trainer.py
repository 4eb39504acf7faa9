"""The Hugging Face Trainer integration (resumable.integrations.transformers, issue #18): every checkpoint-N is
committed with a manifest and pruned only after a commit; a half-written folder is never resumed from; SIGKILL
(between saves and during one), SIGTERM and the time budget leave a committed checkpoint the run resumes from to
the uninterrupted run's weights and per-step log; a fresh VM brings the newest durable checkpoint back from Drive.

A tiny GPT-2 built from a config on synthetic tokens (tests/hf_train.py); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import env, wait_for

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import hf_train  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from resumable.checkpoint.layout import TRAINER  # noqa: E402
from resumable.errors import NothingToResume  # noqa: E402
from resumable.integrations import hf_checkpoints as hf  # noqa: E402
from resumable.integrations.transformers import ResumableCallback, latest_valid  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "hf_train.py"


def train(output_dir: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(output_dir), *args], capture_output=True, text=True,
                          timeout=300, env=env(**extra_env), stdin=subprocess.DEVNULL)


def start(output_dir: Path, *args: str, **extra_env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), str(output_dir), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(**extra_env), stdin=subprocess.DEVNULL)


def committed(output_dir: Path) -> list[int]:
    return [info.step for info in hf.checkpoints(output_dir).inspect() if info.valid]


def result(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run: 40 steps, a checkpoint every 5."""
    where = tmp_path_factory.mktemp("hf-reference")
    done = train(where / "out", "--result", str(where / "result.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    return result(where / "result.json")


def assert_same_as(reference: dict, path: Path) -> None:
    got = result(path)
    assert got["global_step"] == 40
    differing = [step for step in reference["steps"] if reference["steps"][step] != got["steps"].get(step)]
    assert not differing, f"per-step log differs from step {differing[0]}: {got['steps'][differing[0]]} vs " \
                          f"{reference['steps'][differing[0]]}"
    assert got["fingerprint"] == reference["fingerprint"], "final weights differ from the uninterrupted run"


# -- in process: commit and retention ---------------------------------------------------------------------
class SeenAtSave(TrainerCallback):
    """Records, at each on_save, which checkpoint folders exist and which are committed."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int], list[int]]] = []

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        out = Path(args.output_dir)
        self.seen.append((state.global_step, [s for s, _ in hf.checkpoints(out).step_dirs()], committed(out)))


def test_each_save_is_committed_and_pruned_only_after_the_commit(tmp_path: Path) -> None:
    before, after = SeenAtSave(), SeenAtSave()
    callback = ResumableCallback()
    trainer = hf_train.build(str(tmp_path / "out"), 12, 5, 1, [before, callback, after])
    trainer.train()
    assert trainer.args.save_total_limit is None and callback.keep == 1, "the callback applies the limit itself"
    # Between the Trainer's save and the commit, the previous committed checkpoint is still there...
    assert [(step, c) for step, _, c in before.seen] == [(5, []), (10, [5]), (12, [10])]
    # ...and once the new one is committed, only it is kept.
    assert [(step, folders, c) for step, folders, c in after.seen] == [(5, [5], [5]), (10, [10], [10]),
                                                                       (12, [12], [12])]
    assert callback.exit_code == 0 and callback.stopped_early is None
    manifest = json.loads((tmp_path / "out" / "checkpoint-12" / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["run_id"] == callback.run_id
    assert {"model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json"} <= set(manifest["files"])


def test_the_trainers_own_rotation_deletes_the_previous_checkpoint_before_on_save(tmp_path: Path) -> None:
    """Why the callback takes save_total_limit over: without it, rotation runs inside the save, before on_save,
    so a kill right after it leaves only the newest folder, before anything could vouch for it."""
    before = SeenAtSave()
    hf_train.build(str(tmp_path / "out"), 12, 5, 1, [before]).train()
    assert [(step, folders) for step, folders, _ in before.seen] == [(5, [5]), (10, [10]), (12, [12])]


def test_a_half_written_or_damaged_checkpoint_is_never_chosen(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    out = tmp_path / "out"
    hf_train.build(str(out), 15, 5, None, [ResumableCallback()]).train()
    assert committed(out) == [5, 10, 15]
    # a save killed half-way: some files, no manifest
    partial = out / "checkpoint-20"
    partial.mkdir()
    shutil.copy(out / "checkpoint-15" / "model.safetensors", partial / "model.safetensors")
    # bit rot in the newest committed one: same size, one byte changed
    optimizer = out / "checkpoint-15" / "optimizer.pt"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    optimizer.write_bytes(bytes(data))
    assert get_last_checkpoint(str(out)) == str(partial), "transformers alone takes the half-written folder"
    with caplog.at_level("WARNING", logger="resumable"):
        assert latest_valid(out) == str(out / "checkpoint-10")
    said = caplog.text
    assert "skipping checkpoint-20" in said and "no manifest.json (the save did not finish)" in said
    assert "skipping checkpoint-15" in said and "optimizer.pt does not match its sha256" in said
    # a manifest copied into another folder does not vouch for it
    (out / "checkpoint-10" / "manifest.json").replace(out / "checkpoint-5" / "manifest.json")
    shutil.rmtree(out / "checkpoint-10")
    with pytest.raises(NothingToResume, match="none verifies"):
        latest_valid(out)


# -- save_strategy="best": the Trainer decides to save after evaluating, after on_step_end -----------------
def _best_trainer(output_dir: Path, max_steps: int, callbacks: list, greater: bool = False, limit: int | None = None):
    """hf_train's tiny GPT-2, evaluated every 2 steps on 8 samples and saved when eval_loss is a new best
    (``greater``: "best" is the highest loss, so only the first evaluation is a new best)."""
    return hf_train.build(str(output_dir), max_steps, 2, limit, callbacks,
                          torch.utils.data.Subset(hf_train.Tokens(), range(8)), save_strategy="best",
                          eval_strategy="steps", eval_steps=2, metric_for_best_model="loss", greater_is_better=greater)


class ManifestAtSave(TrainerCallback):
    """At each on_save, before ResumableCallback commits: whether the folder just written has a manifest."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, bool]] = []

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        folder = Path(args.output_dir) / TRAINER.name(state.global_step)
        self.seen.append((state.global_step, (folder / "manifest.json").exists()))


def test_save_strategy_best_clears_the_old_manifest_before_each_save_and_commits_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    callback, spy = ResumableCallback(), ManifestAtSave()
    trainer = _best_trainer(out, 8, [spy, callback], limit=2)
    trainer.train()
    evals = [(e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e]
    assert [s for s, _ in evals] == [2, 4, 6, 8] and [v for _, v in evals] == sorted(v for _, v in evals)[::-1], \
        f"each evaluation is a new best, so each one saves: {evals}"
    assert spy.seen == [(2, False), (4, False), (6, False), (8, False)]
    assert committed(out) == [6, 8], "every save committed, and save_total_limit=2 applied after each commit"
    # Back to checkpoint-6 (the user's choice, or checkpoint-8 found damaged): the Trainer writes checkpoint-8 again.
    # Its manifest, from the first session, must go before the Trainer replaces the files, as with save_steps.
    again, spy = ResumableCallback(), ManifestAtSave()
    _best_trainer(out, 8, [spy, again], limit=2).train(resume_from_checkpoint=str(out / "checkpoint-6"))
    assert spy.seen == [(8, False)], "the old manifest of checkpoint-8 vouched for it while it was rewritten"
    assert committed(out) == [6, 8] and again.exit_code == 0


def test_save_strategy_best_saves_a_stop_on_an_evaluation_step_that_is_not_a_new_best(tmp_path: Path) -> None:
    """SIGTERM at step 4, an evaluation step that is not a new best: the Trainer sets should_save to False after
    evaluating, dropping the stop's save; the callback has the Trainer save at the epoch end that follows."""

    class TermAt4(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            if state.global_step == 4:
                os.kill(os.getpid(), signal.SIGTERM)  # ResumableCallback's handler only sets its flag

    out = tmp_path / "out"
    callback = ResumableCallback()
    trainer = _best_trainer(out, 12, [TermAt4(), callback], greater=True)
    trainer.train()
    assert trainer.state.global_step == 4 and callback.stopped_early == "signal SIGTERM"
    assert trainer.state.best_global_step == 2, "step 4's evaluation was not a new best"
    assert committed(out) == [2, 4], "the state at the stop is committed"
    assert callback.exit_code == 75
    assert latest_valid(out) == str(out / "checkpoint-4")


# -- subprocesses: kills, signals, budget ----------------------------------------------------------------
# Soak set: the kill during a save below also kills, resumes through latest_valid and compares with the
# uninterrupted run; this one differs only in when the kill lands.
@pytest.mark.soak
def test_sigkill_between_saves_resumes_to_the_uninterrupted_run(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = start(out, "--step-sleep", "0.05")
    wait_for(proc, lambda: 10 in committed(out), "checkpoint-10 was committed")
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL and max(committed(out)) < 40
    resumed = train(out, "--result", str(tmp_path / "result.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"RESUME-FROM {out}/checkpoint-" in resumed.stdout
    assert_same_as(reference, tmp_path / "result.json")


def test_sigkill_during_a_save_falls_back_to_the_previous_commit(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = start(out, "--pause-before-commit", "15")
    wait_for(proc, lambda: (out / "checkpoint-15" / "trainer_state.json").exists() and proc.stdout.readline()
             .startswith("SAVED-UNCOMMITTED"), "the Trainer saved checkpoint-15")
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert (out / "checkpoint-15").is_dir() and not (out / "checkpoint-15" / "manifest.json").exists()
    assert committed(out) == [5, 10]
    resumed = train(out, "--result", str(tmp_path / "result.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "skipping checkpoint-15" in resumed.stderr and "the save did not finish" in resumed.stderr
    assert f"RESUME-FROM {out}/checkpoint-10" in resumed.stdout
    assert_same_as(reference, tmp_path / "result.json")


def test_sigterm_saves_commits_and_exits_75(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = start(out, "--step-sleep", "0.1")
    wait_for(proc, lambda: 5 in committed(out), "checkpoint-5 was committed")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err[-3000:]
    assert "stopped early (signal SIGTERM)" in err and "exit code 75" in err
    stopped_at = max(committed(out))
    assert 5 <= stopped_at < 40
    state = json.loads((out / f"checkpoint-{stopped_at}" / "trainer_state.json").read_text())
    assert state["global_step"] == stopped_at, "the checkpoint committed is the state at the stop"
    resumed = train(out, "--result", str(tmp_path / "result.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"RESUME-FROM {out}/checkpoint-{stopped_at}" in resumed.stdout
    assert_same_as(reference, tmp_path / "result.json")


# In the soak set (about 14 s): the budget's decision is test_preemption.py's Budget, and the save-and-stop it
# triggers in the Trainer is test_sigterm_saves_commits_and_exits_75's path.
@pytest.mark.soak
def test_the_time_budget_stops_with_75_and_a_committed_checkpoint(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # 40 steps of at least 0.1 s each cannot fit in 1 s: the budget stops it
    stopped = train(out, "--step-sleep", "0.1", "--time-limit", "1s")
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "time budget" in stopped.stderr
    stopped_at = max(committed(out))
    assert stopped_at < 40
    assert json.loads((out / f"checkpoint-{stopped_at}" / "trainer_state.json").read_text())["global_step"] == \
        stopped_at
    resumed = train(out, "--result", str(tmp_path / "result.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_as(reference, tmp_path / "result.json")


# -- Drive: a fresh VM ------------------------------------------------------------------------------------
def test_a_fresh_vm_restores_from_drive_and_finishes(reference: dict, tmp_path: Path) -> None:
    from fakedrive import FakeDrive
    from test_drive import drive_env, store

    from resumable.storage.tiered import durable_steps

    with FakeDrive() as fake:
        url = "gdrive://root/runs/hf"
        out = tmp_path / "out"
        s = store(fake, path="runs/hf")
        proc = start(out, "--step-sleep", "0.05", "--drive", url, "--limit", "2", **drive_env(fake))
        wait_for(proc, lambda: any(step >= 10 for step in durable_steps(s, tmp_path)), "step 10 was on Drive")
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        on_drive = durable_steps(s, tmp_path)
        assert on_drive and max(on_drive) < 40
        shutil.rmtree(out)  # a fresh VM: nothing local survives
        resumed = train(out, "--drive", url, "--limit", "2", "--result", str(tmp_path / "result.json"),
                        **drive_env(fake))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"restored checkpoint-{max(on_drive)}" in resumed.stderr
        assert f"RESUME-FROM {out}/checkpoint-{max(on_drive)}" in resumed.stdout
        assert_same_as(reference, tmp_path / "result.json")
        assert durable_steps(s, tmp_path) == [35, 40], "Drive keeps what local retention keeps"
        assert s.list_checkpoints() == ["checkpoint-35", "checkpoint-40"], "Drive holds the Trainer's own folders"
        assert not fake.server_errors, fake.server_errors
    assert not list(out.glob(".resumable/*/checkpoints")), "no second copy (or view) of the checkpoints"


def test_a_finished_run_is_not_trained_again(tmp_path: Path) -> None:
    # 64 samples, batch 4: 16 steps an epoch, so max_steps 20 ends inside the second epoch
    out = tmp_path / "out"
    first = ResumableCallback()
    trainer = hf_train.build(str(out), 20, 5, None, [first])
    first.train(trainer)
    assert trainer.state.global_step == 20 and committed(out)[-1] == 20
    final = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    again = ResumableCallback()  # the notebook cell run again after the end: a new, untrained model
    rerun = hf_train.build(str(out), 20, 5, None, [again])
    assert again.train(rerun) is None and again.exit_code == 0
    assert committed(out)[-1] == 20 and not (out / "checkpoint-21").exists()
    # ... holds the final weights and the log history, as the train() that completed the run left its trainer
    assert all(torch.equal(rerun.model.state_dict()[k], v) for k, v in final.items())
    steps = [record for record in trainer.state.log_history if "train_runtime" not in record]  # not the summary
    assert rerun.state.global_step == 20 and rerun.state.log_history == steps
    more = ResumableCallback()  # more steps asked: it trains on from step 20
    longer = hf_train.build(str(out), 25, 5, None, [more])
    more.train(longer)
    assert longer.state.global_step == 25 and committed(out)[-1] == 25
    # What a plain trainer.train(resume_from_checkpoint=...) does with a finished run: one step more (transformers)
    plain = hf_train.build(str(out), 25, 5, None, [ResumableCallback()])
    plain.train(resume_from_checkpoint=latest_valid(out))
    assert plain.state.global_step == 26


def test_drive_and_the_output_dir_end_with_save_total_limit_when_uploads_are_slow(tmp_path: Path) -> None:
    # Uploads slower than the saves: retention keeps the checkpoint being uploaded at each save. Before, the one in
    # flight at the last save stayed for good, in the output dir and on Drive (three checkpoints for a limit of 2).
    from fakedrive import FakeDrive
    from test_drive import drive_env, store

    from resumable.storage.tiered import durable_steps

    with FakeDrive(bandwidth=1_000_000) as fake:
        out = tmp_path / "out"
        done = train(out, "--drive", "gdrive://root/runs/slow", "--limit", "2", **drive_env(fake))
        assert done.returncode == 0, done.stderr[-3000:]
        local = sorted(step for step, _ in hf.checkpoints(out).step_dirs())
        assert local == [35, 40], f"output dir keeps {local}"
        on_drive = durable_steps(store(fake, path="runs/slow"), tmp_path)
        assert on_drive == [35, 40], "Drive keeps what the output dir keeps"
