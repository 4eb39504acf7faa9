"""Issue 31, item 10 (the small ones): the Colab budget from the VM's lifetime without a floor, the one-cycle schedule
ending with the run's last optimizer step at any world size, and misspelt Drive URLs refused instead of trained
into a local folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import env, records, run

from resumable import Location, Reporting, Run, platforms
from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.config import TrainConfig
from resumable.distributed import Distributed
from resumable.engine.data.sources import IndexBatches
from resumable.engine.data.wrap import as_source
from resumable.errors import EXIT_RESUME, EXIT_USAGE, ResumableError
from resumable.storage import open_run_location
from resumable.tasks.mnist_task import MnistTask

BIN = Path(sys.executable).parent
HOUR = 3600.0
TINY = ["--device", "cpu", "--no-download", "--no-progress", "--log-every", "1"]


# -- the Colab budget -----------------------------------------------------------------------------------------------
def test_colab_budget_takes_the_vm_lifetime_from_the_environment_and_has_no_floor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab-test")
    monkeypatch.delenv("RESUMABLE_COLAB_VM_LIFETIME", raising=False)
    monkeypatch.setattr(platforms, "vm_uptime_s", lambda: 3 * HOUR)
    margin = platforms.COLAB_SAFETY_S
    assert platforms.colab_default_limit_s() == pytest.approx(12 * HOUR - margin - 3 * HOUR)  # the default
    for value in ("24h", "24", "23h60m"):  # Colab Pro; a bare number is hours
        monkeypatch.setenv("RESUMABLE_COLAB_VM_LIFETIME", value)
        assert platforms.colab_default_limit_s() == pytest.approx(24 * HOUR - margin - 3 * HOUR), value
    for value in ("soon", "0", "-3h", "nan", "inf"):
        monkeypatch.setenv("RESUMABLE_COLAB_VM_LIFETIME", value)
        with pytest.raises(ResumableError, match="RESUMABLE_COLAB_VM_LIFETIME=.* write e.g. 24h"):
            platforms.colab_default_limit_s()
    # Less than the margin left: nothing (was 60 s: a minute of training inside the margin kept for the last save).
    monkeypatch.delenv("RESUMABLE_COLAB_VM_LIFETIME")
    monkeypatch.setattr(platforms, "vm_uptime_s", lambda: 12 * HOUR - margin / 2)
    assert platforms.colab_default_limit_s() == 0.0
    monkeypatch.setattr(platforms, "vm_uptime_s", lambda: 13 * HOUR)
    assert platforms.colab_default_limit_s() == 0.0


def test_a_colab_vm_at_the_end_of_its_life_saves_and_stops_before_any_step(tiny_mnist: Path, tmp_path: Path) -> None:
    # A lifetime shorter than the safety margin: whatever this machine's uptime, nothing is left.
    done = run(["--run-dir", str(tmp_path / "run"), "--data-dir", str(tiny_mnist), "--epochs", "1", *TINY],
               COLAB_RELEASE_TAG="release-colab-test", RESUMABLE_COLAB_VM_LIFETIME="10m")
    assert done.returncode == EXIT_RESUME, done.stderr[-2000:]
    assert "less than 20m is left of its 10m lifetime (RESUMABLE_COLAB_VM_LIFETIME=10m" in done.stderr
    assert "saving a checkpoint and stopping now" in done.stderr
    steps = [i.step for i in CheckpointManager(checkpoints_dir(tmp_path / "run")).inspect(deep=False) if i.valid]
    assert steps == [0], "a committed checkpoint, and not one step trained"
    assert not [r for r in records(tmp_path / "run") if "loss" in r]


# -- the one-cycle schedule -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [10, 47])  # 96 samples: uneven splits; 47 x 2 ranks drops a 2-sample last step
def test_onecycle_spans_exactly_the_optimizer_steps_of_every_rank(tiny_mnist: Path, batch: int) -> None:
    cfg = TrainConfig(data_dir=str(tiny_mnist), lr_schedule="onecycle", epochs=2, batch_size=batch, download=False,
                      device="cpu")
    for world in (1, 2, 3):
        task = MnistTask(cfg, torch.device("cpu"), world_size=world)
        size = len(task.data.train)
        # The batches each rank's loop is given, from the sampler the engine builds for Run(data=IndexBatches(...)).
        samplers = [as_source(IndexBatches(lambda i: i, size), {}, batch, cfg.seed, True, False,
                              Distributed(rank, world))[1] for rank in range(world)]
        per_rank = [[indices for epoch in range(cfg.epochs) for _, indices, _, _ in s.walk(epoch, 0)]
                    for s in samplers]
        assert len({len(batches) for batches in per_rank}) == 1, "every rank takes the same number of steps"
        assert task.scheduler.total_steps == len(per_rank[0]), (batch, world)
        group = task.optimizer.param_groups[0]
        used = []
        for indices in per_rank[0]:
            used.append(group["lr"])
            task.train_step(indices)
        assert used[-1] == pytest.approx(group["min_lr"], rel=1e-6), "the last step trains at the schedule's end"
        # What the metrics record after the last step (and the final checkpoint holds): the end, not past it.
        assert group["lr"] == pytest.approx(group["min_lr"], rel=1e-6), (batch, world, group["lr"])


def test_onecycle_under_torchrun_ends_at_the_schedules_end(tiny_mnist: Path, tmp_path: Path) -> None:
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(BIN / "resumable-train"),
               "--run-dir", str(tmp_path), "--data-dir", str(tiny_mnist), "--epochs", "1", "--batch-size", "10",
               "--lr-schedule", "onecycle", *TINY]
    done = subprocess.run(command, env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    lrs = [r["lr"] for r in records(tmp_path) if "lr" in r]
    assert len(lrs) == 5, "96 samples in steps of 10 x 2 ranks: 5 steps"
    assert lrs[-1] == pytest.approx(1e-3 / 25 / 1e4, rel=1e-6), lrs  # max_lr / div_factor / final_div_factor


# -- misspelt Drive URLs --------------------------------------------------------------------------------------------
NEAR_MISSES = [("gdrive:/x", "gdrive://x"), ("gdrive:x", "gdrive://x"), ("GDrive://x", "gdrive://x"),
               ("gdrive//root/x", "gdrive://root/x"), ("drive://x", "gdrive://x"),
               ("googledrive:/root/x", "gdrive://root/x"), ("google-drive://x", "gdrive://x")]


def test_resumable_train_refuses_a_misspelt_drive_url_and_creates_nothing(tiny_mnist: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([str(BIN / "resumable-train"), "--run-dir", "gdrive:/x", "--data-dir", str(tiny_mnist),
                           "--max-steps", "2", *TINY], cwd=work, capture_output=True, text=True, timeout=120,
                          env=env(XDG_CACHE_HOME=str(tmp_path / "cache")), stdin=subprocess.DEVNULL)
    assert done.returncode == EXIT_USAGE, done.stderr[-2000:]
    assert "run dir 'gdrive:/x' looks like a Google Drive URL: write gdrive://x" in done.stderr
    assert list(work.iterdir()) == [] and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("typed", "right"), NEAR_MISSES)
def test_run_refuses_a_misspelt_drive_url_and_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               typed: str, right: str) -> None:
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    run = Run(Location(typed, cache_dir=str(tmp_path / "cache")), model=model,
              optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data, batch_size=4,
              reporting=Reporting(progress=False))
    with pytest.raises(ResumableError, match=f"looks like a Google Drive URL: write {right} "):
        for _ in run:
            pass
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("local", ["gdrive/x", "drive/x", "./gdrive:/x", "runs/gdrive:x"])
def test_folders_that_only_resemble_drive_urls_stay_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          local: str) -> None:
    monkeypatch.chdir(tmp_path)
    location = open_run_location(local, cache_dir=str(tmp_path / "cache"))
    assert location.remote is None and location.local_dir == Path(local)


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_inspect_and_verify_refuse_a_misspelt_drive_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        command: str) -> None:
    from click.testing import CliRunner

    from resumable.cli import main

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, [command, "gdrive:/root/x"])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "looks like a Google Drive URL: write gdrive://root/x" in result.output
    assert list(tmp_path.iterdir()) == []
