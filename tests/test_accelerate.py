"""The Accelerate integration (resumable.integrations.accelerate, issue #35 item 1): every ``checkpoint_N`` that
``accelerator.save_state`` writes is committed with a manifest and pruned only after a commit; a half-written folder
is never loaded; a failed RNG restore is an error; SIGKILL (at a step, inside a save, at a random moment), SIGTERM and
the time budget leave a committed state the run resumes from to the uninterrupted run's weights and per-step losses;
a fresh VM brings the newest durable one back from Drive.

A tiny MLP with dropout on synthetic data (tests/accelerate_train.py), CPU, one thread; nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import env, wait_for

pytest.importorskip("accelerate")

import accelerate_train  # noqa: E402
import numpy as np  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

from resumable.errors import ResumeNotApplied  # noqa: E402
from resumable.faults import Faults  # noqa: E402
from resumable.integrations.accelerate import Position, ResumableState, checkpoints  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "accelerate_train.py"


def train(run_dir: Path, *args: str, faults: Faults | None = None, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(run_dir), *args], capture_output=True, text=True,
                          timeout=300, env=env(**extra_env, **(faults.to_env() if faults else {})),
                          stdin=subprocess.DEVNULL)


def start(run_dir: Path, *args: str, **extra_env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), str(run_dir), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(**extra_env), stdin=subprocess.DEVNULL)


def committed(run_dir: Path) -> list[int]:
    return [info.step for info in checkpoints(run_dir).inspect() if info.valid]


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's logged loss; a step trained again after a kill must log the same loss again."""
    seen: dict[int, float] = {}
    for line in (run_dir / "losses.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert seen.setdefault(record["step"], record["loss"]) == record["loss"], f"step {record['step']} trained " \
                                                                                  f"again gave another loss"
    return seen


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run: 36 steps (3 epochs of 12), a checkpoint every 4."""
    where = tmp_path_factory.mktemp("acc-reference")
    done = train(where / "run", "--result", str(where / "result.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    return {"losses": losses(where / "run"), **json.loads((where / "result.json").read_text())}


def assert_same_as(reference: dict, run_dir: Path, result: Path) -> None:
    got = losses(run_dir)
    differing = [step for step in reference["losses"] if reference["losses"][step] != got.get(step)]
    assert not differing, f"the loss differs from step {differing[0]} on"
    assert json.loads(result.read_text()) == {"step": 36, "fingerprint": reference["fingerprint"]}, \
        "final weights and optimizer differ from the uninterrupted run"


# -- subprocesses: kills, signals, budget ----------------------------------------------------------------------
def test_sigkill_at_a_step_inside_a_save_and_at_random_resumes_to_the_uninterrupted_run(reference: dict,
                                                                                        tmp_path: Path) -> None:
    run = tmp_path / "run"
    # 1. killed right after step 18 (mid-epoch 1): the newest commit is checkpoint_16 (epoch 1, batch 4)
    killed = train(run, faults=Faults(kill_at_step=18))
    assert killed.returncode == -signal.SIGKILL and committed(run) == [12, 16]
    # 2. resumed from it through skip_first_batches, killed inside the save of step 24: files written, no manifest
    killed = train(run, faults=Faults(kill_in_save_at_step=24))
    assert killed.returncode == -signal.SIGKILL and "RESUME-FROM step 16" in killed.stdout
    assert (run / "checkpoints" / "checkpoint_24" / "model.safetensors").exists()
    assert committed(run) == [16, 20], "keep=2, and the half-written checkpoint_24 is not committed"
    # 3. the half-written folder is skipped; then a SIGKILL at a random moment
    proc = start(run, "--step-sleep", "0.05")
    wait_for(proc, lambda: proc.stdout.readline().startswith("RESUME-FROM"), "the run resumed")
    time.sleep(random.Random().uniform(0.1, 0.6))
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert "skipping checkpoint_24" in err and "the save did not finish" in err
    assert "resuming from checkpoint_20" in err
    # 4. to the end
    done = train(run, "--result", str(tmp_path / "result.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_as(reference, run, tmp_path / "result.json")
    again = train(run, "--result", str(tmp_path / "again.json"))  # a run already complete trains nothing
    assert again.returncode == 0 and "RESUME-FROM step 36" in again.stdout
    assert_same_as(reference, run, tmp_path / "again.json")


def test_sigterm_and_the_time_budget_save_commit_and_exit_75(reference: dict, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = start(run, "--step-sleep", "0.05", "--save-every", "5")
    wait_for(proc, lambda: 5 in committed(run), "checkpoint_5 was committed")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "stopped early (signal SIGTERM)" in err and "exit code 75" in err
    stopped_at = max(committed(run))
    assert 5 < stopped_at < 36 and stopped_at % 5, "the state at the stop, off the save_every grid, is committed"
    # 36 steps of at least 0.05 s cannot fit in 1 s: the budget stops it
    stopped = train(run, "--step-sleep", "0.05", "--time-limit", "1s")
    assert stopped.returncode == 75 and "time budget" in stopped.stderr, stopped.stderr[-3000:]
    assert stopped_at < max(committed(run)) < 36
    done = train(run, "--result", str(tmp_path / "result.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_as(reference, run, tmp_path / "result.json")


def test_a_fresh_vm_restores_from_drive_and_finishes(reference: dict, tmp_path: Path) -> None:
    from fakedrive import FakeDrive
    from test_drive import drive_env, store

    from resumable.storage.tiered import durable_steps

    with FakeDrive() as fake:
        url = "gdrive://root/runs/acc"
        run = tmp_path / "run"
        s = store(fake, path="runs/acc")
        proc = start(run, "--step-sleep", "0.05", "--drive", url, **drive_env(fake))
        wait_for(proc, lambda: any(step >= 12 for step in durable_steps(s, tmp_path)), "step 12 was on Drive")
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        on_drive = durable_steps(s, tmp_path)
        assert on_drive and max(on_drive) < 36
        shutil.rmtree(run)  # a fresh VM: nothing local survives
        done = train(run, "--drive", url, "--result", str(tmp_path / "result.json"), **drive_env(fake))
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"restored checkpoint_{max(on_drive)}" in done.stderr
        assert f"RESUME-FROM step {max(on_drive)}" in done.stdout
        assert durable_steps(s, tmp_path) == [32, 36], "Drive keeps what local retention keeps"
        assert not fake.server_errors, fake.server_errors
    # the losses before the restored step were logged on the lost VM: compare the final state and what came after
    assert json.loads((tmp_path / "result.json").read_text())["fingerprint"] == reference["fingerprint"]


# -- in process: choice, retention, RNG check ----------------------------------------------------------------
def test_a_half_written_newest_folder_is_skipped_where_accelerate_would_load_it(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    assert accelerate_train.main([str(tmp_path), "--epochs", "1"]) == 0
    assert committed(tmp_path) == [8, 12]
    half = tmp_path / "checkpoints" / "checkpoint_16"  # a save killed before its commit: some files, no manifest
    half.mkdir()
    shutil.copy(tmp_path / "checkpoints" / "checkpoint_12" / "model.safetensors", half)
    accelerator = accelerate_train.build(project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))[0]
    with pytest.raises(FileNotFoundError):  # Accelerate's own choice: the highest number, complete or not
        accelerator.load_state()
    ckpt = ResumableState(accelerator)  # run_dir: the project_dir
    assert ckpt.load_state() == Position(12, 0, 12)
    assert "skipping checkpoint_16" in caplog.text and "no manifest.json (the save did not finish)" in caplog.text
    assert ckpt.save_state(12, 1, 0) is None, "nothing trained since the load: the folder resumed from stays"
    ckpt.finish()


def test_pruning_runs_only_after_the_new_checkpoint_is_committed(tmp_path: Path) -> None:
    # total_limit=1: Accelerate's rotation would delete the only checkpoint before writing the next one
    accelerator = accelerate_train.build(project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1))[0]
    ckpt = ResumableState(accelerator)
    assert ckpt.keep == 1 and ckpt.load_state() == Position()
    seen = []
    save = accelerator.save_state

    def spy(output_dir: str, **kwargs: object) -> object:
        seen.append((Path(output_dir).name, committed(tmp_path)))
        return save(output_dir, **kwargs)

    accelerator.save_state = spy
    for step in (4, 8, 12):
        ckpt.save_state(step, 0, step)
    assert seen == [("checkpoint_4", []), ("checkpoint_8", [4]), ("checkpoint_12", [8])]
    assert committed(tmp_path) == [12]
    assert accelerator.project_configuration.automatic_checkpoint_naming, "Accelerate's setting is given back"
    # a save that fails before its commit leaves the newest committed one in place
    ckpt.store.adopt = lambda step, meta: (_ for _ in ()).throw(OSError("disk full (injected)"))
    with pytest.raises(OSError):
        ckpt.save_state(16, 1, 4)
    assert committed(tmp_path) == [12] and (tmp_path / "checkpoints" / "checkpoint_16").is_dir()
    ckpt.finish()


def test_a_failed_rng_restore_is_an_error_naming_the_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert accelerate_train.main([str(tmp_path), "--epochs", "1"]) == 0

    def broken(state: object) -> None:
        raise ValueError("state is not a legal MT19937 state (faked)")

    monkeypatch.setattr(np.random, "set_state", broken)  # inside accelerate's try: it logs at INFO and goes on
    ckpt = ResumableState(accelerate_train.build()[0], tmp_path)
    with pytest.raises(ResumeNotApplied, match=r"did not restore the .*torch CPU RNG.*accelerate#4283"):
        ckpt.load_state()
    ckpt.finish()
