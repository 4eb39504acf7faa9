"""The Lightning integration (resumable.integrations.lightning, issue 35): each checkpoint is committed in its own step
folder with a manifest, pruned only after a commit; a half-written folder is never resumed from; SIGKILL (after a step
and inside a save), SIGTERM and the time budget leave a committed checkpoint the run resumes from to the
uninterrupted run's weights and per-step metrics, each step logged once.

tests/lightning_train.py: a tiny MLP with dropout on synthetic data, torchdata's StatefulDataLoader (or a plain
DataLoader with --plain), 40 steps of batch 4 (16 an epoch), a checkpoint every 5 steps, CPU, one thread.
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

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

from resumable.errors import NothingToResume  # noqa: E402
from resumable.integrations import lightning_io as lio  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "lightning_train.py"


def train(dirpath: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(dirpath), *args], capture_output=True, text=True,
                          timeout=300, env=env(), stdin=subprocess.DEVNULL)


def committed(dirpath: Path) -> list[int]:
    return [info.step for info in lio.checkpoints(dirpath).inspect() if info.valid]


def finish(dirpath: Path, result: Path, *args: str) -> subprocess.CompletedProcess:
    done = train(dirpath, "--result", str(result), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def assert_same_as(reference: dict, path: Path) -> None:
    got = json.loads(path.read_text())
    assert got["global_step"] == 40
    steps = [record["step"] for record in got["metrics"]]
    assert steps == list(range(1, 41)), f"each step logged once, in order: {steps}"
    differing = [a["step"] for a, b in zip(reference["metrics"], got["metrics"], strict=True) if a != b]
    assert not differing, f"the metrics of step {differing[0]} differ from the uninterrupted run's"
    assert got["fingerprint"] == reference["fingerprint"], "final weights differ from the uninterrupted run"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    where = tmp_path_factory.mktemp("lightning-reference")
    finish(where / "ckpt", where / "result.json")
    assert committed(where / "ckpt") == [35, 40], "keep=2, pruned after each commit"
    return json.loads((where / "result.json").read_text())


def test_sigkill_after_a_step_and_inside_a_save_resumes_to_the_uninterrupted_run(reference: dict,
                                                                                  tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    # a kill at a random step between two checkpoints (mid-epoch or not), then one inside the save of step 30:
    # the file is written, the manifest not
    at = random.Random().choice([s for s in range(6, 29) if s % 5])
    killed = train(out, "--kill-at-step", str(at))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert max(committed(out)) == at - at % 5, f"killed at step {at}"
    killed = train(out, "--kill-in-save-at-step", "30")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    half = out / "step-000000030"
    assert (half / lio.FILE).is_file() and not (half / "manifest.json").exists()
    assert committed(out) == [20, 25]
    done = finish(out, tmp_path / "result.json")
    assert "skipping step-000000030" in done.stderr and "the save did not finish" in done.stderr
    assert f"RESUME-FROM {out}/step-000000025/{lio.FILE}" in done.stdout
    assert_same_as(reference, tmp_path / "result.json")
    assert committed(out) == [35, 40] and not half.exists(), "the half-written folder is pruned after a commit"


def test_a_half_written_or_damaged_checkpoint_is_never_chosen(reference: dict, tmp_path: Path, caplog) -> None:  # noqa: ANN001
    out = tmp_path / "ckpt"
    assert train(out, "--max-steps", "15").returncode == 0
    assert committed(out) == [10, 15]
    partial = out / "step-000000020"  # a save killed half-way: a truncated file, no manifest
    partial.mkdir()
    partial.joinpath(lio.FILE).write_bytes((out / "step-000000015" / lio.FILE).read_bytes()[:100])
    with caplog.at_level("WARNING", logger="resumable"):
        assert lio.latest_valid(out) == str(out / "step-000000015" / lio.FILE)
    assert "skipping step-000000020" in caplog.text and "no manifest.json (the save did not finish)" in caplog.text
    damaged = out / "step-000000015" / lio.FILE  # bit rot: same size, one byte changed
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert lio.latest_valid(out) == str(out / "step-000000010" / lio.FILE)
    shutil.rmtree(out / "step-000000010")
    with pytest.raises(NothingToResume, match="none verifies"):
        lio.latest_valid(out)


def test_sigterm_saves_commits_and_exits_75(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(out), "--step-sleep", "0.1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(), stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while 5 not in committed(out):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 5 was committed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "stopped early (signal SIGTERM)" in err and "exit code 75" in err
    stopped_at = max(committed(out))
    assert 5 <= stopped_at < 40
    done = finish(out, tmp_path / "result.json")
    assert f"RESUME-FROM {out}/step-{stopped_at:09d}/{lio.FILE}" in done.stdout
    assert_same_as(reference, tmp_path / "result.json")


def test_the_time_budget_stops_with_75_and_a_committed_checkpoint(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    stopped = train(out, "--step-sleep", "0.1", "--time-limit", "1.5s")  # 40 steps of 0.1 s cannot fit
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "time budget" in stopped.stderr
    assert 0 < max(committed(out)) < 40
    finish(out, tmp_path / "result.json")
    assert_same_as(reference, tmp_path / "result.json")


def test_a_fresh_vm_restores_from_drive_and_finishes(reference: dict, tmp_path: Path) -> None:
    from fakedrive import FakeDrive
    from test_drive import drive_env, store

    from resumable.storage.tiered import durable_steps

    with FakeDrive() as fake:
        url, out = "gdrive://root/runs/light", tmp_path / "ckpt"
        remote = store(fake, path="runs/light")
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(out), "--step-sleep", "0.05", "--drive", url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(**drive_env(fake)),
                                stdin=subprocess.DEVNULL)
        wait_for(proc, lambda: any(step >= 15 for step in durable_steps(remote, tmp_path)), "step 15 was on Drive")
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        on_drive = durable_steps(remote, tmp_path)
        assert on_drive and max(on_drive) < 40
        shutil.rmtree(out)  # a fresh VM: nothing local survives
        done = subprocess.run([sys.executable, str(SCRIPT), str(out), "--drive", url, "--result",
                               str(tmp_path / "result.json")], capture_output=True, text=True, timeout=300,
                              env=env(**drive_env(fake)), stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"RESUME-FROM {out}/step-{max(on_drive):09d}/{lio.FILE}" in done.stdout
        assert durable_steps(remote, tmp_path) == [35, 40], "Drive keeps what local retention keeps"
        assert not fake.server_errors, fake.server_errors
    # the metrics before the restored step were logged on the lost VM: compare the final weights
    assert json.loads((tmp_path / "result.json").read_text())["fingerprint"] == reference["fingerprint"]


# In the soak set (about 40 s on 2 busy cores: five runs): what docs/lightning.md says of a plain DataLoader.
@pytest.mark.soak
def test_a_plain_dataloader_resumes_exactly_from_an_epoch_end_only(tmp_path: Path) -> None:
    """docs/lightning.md's table: a plain shuffled DataLoader resumed from a checkpoint at an epoch's end (step 16)
    is exact; resumed mid-epoch (step 10), Lightning warns and trains other batches."""
    finish(tmp_path / "ref", tmp_path / "ref.json", "--plain")
    reference = json.loads((tmp_path / "ref.json").read_text())
    out = tmp_path / "end"
    assert train(out, "--plain", "--every", "8", "--kill-at-step", "18").returncode == -signal.SIGKILL
    finish(out, tmp_path / "end.json", "--plain", "--every", "8")
    assert_same_as(reference, tmp_path / "end.json")
    out = tmp_path / "mid"
    assert train(out, "--plain", "--kill-at-step", "13").returncode == -signal.SIGKILL
    done = finish(out, tmp_path / "mid.json", "--plain")
    assert "your dataloader is not resumable" in done.stderr
    got = json.loads((tmp_path / "mid.json").read_text())
    assert got["metrics"][:10] == reference["metrics"][:10] and got["metrics"][10] != reference["metrics"][10]


def test_a_step_folders_checkpoint_is_loaded_weights_only(tmp_path: Path) -> None:
    class Recording:
        def load_checkpoint(self, path, map_location=None, weights_only=None):  # noqa: ANN001, ANN201
            return {"weights_only": weights_only}

    io = lio.CommitCheckpointIO(tmp_path, wrapped=Recording())
    assert io.load_checkpoint(lio.checkpoint_file(tmp_path, 5))["weights_only"] is True  # never arbitrary pickles
    assert io.load_checkpoint(tmp_path / "elsewhere.ckpt")["weights_only"] is None  # not ours: as Lightning asks
