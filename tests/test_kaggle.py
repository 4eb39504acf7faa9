"""Kaggle, faked by its environment (KAGGLE_KERNEL_RUN_TYPE) and a stand-in for /kaggle/working: detected like Colab,
its 12 h session limit gives the default budget (counted from the container's start), the default run dir goes
under /kaggle/working (the only folder a saved version keeps) and a run dir elsewhere is warned about, and a saved
version whose limit is near stops with a committed checkpoint (exit 75)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import newest_valid, run
from torch.utils.data import TensorDataset

from resumable import Reporting, Run, Session, platforms
from resumable.config import RunOptions, TrainConfig
from resumable.engine.loop.preemption import session_budget
from resumable.errors import EXIT_RESUME, ResumableError
from resumable.tasks.train_mnist import MnistTraining

HOUR = 3600.0
TINY = ["--device", "cpu", "--no-download", "--no-progress", "--log-every", "1"]


@pytest.fixture
def kaggle(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A Kaggle kernel: its variable set, Colab's not, and /kaggle/working standing in under tmp_path."""
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    monkeypatch.delenv(platforms.KAGGLE_LIFETIME_ENV, raising=False)
    working = tmp_path / "kaggle" / "working"
    working.mkdir(parents=True)
    monkeypatch.setattr(platforms, "KAGGLE_WORKING", working)
    return working


def test_kaggle_is_detected_by_its_kernel_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert not platforms.in_kaggle() and platforms.hosted() is None
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    assert platforms.in_kaggle() and platforms.kaggle_saved_version()
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    assert platforms.in_kaggle() and not platforms.kaggle_saved_version()


def test_the_budget_is_the_session_limit_less_the_margin_counted_from_the_container_start(
        kaggle: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(platforms, "container_age_s", lambda: 3 * HOUR)
    session = platforms.hosted()
    assert session is not None and session.name == "Kaggle session"
    assert session.left_s == pytest.approx(12 * HOUR - platforms.COLAB_SAFETY_S - 3 * HOUR)
    budget = session_budget(RunOptions())
    assert budget.limit_s == pytest.approx(session.left_s)
    assert "Kaggle session detected: stopping cleanly after 8h40m" in capsys.readouterr().err
    monkeypatch.setenv(platforms.KAGGLE_LIFETIME_ENV, "9h")  # a TPU session
    assert platforms.hosted().left_s == pytest.approx(9 * HOUR - platforms.COLAB_SAFETY_S - 3 * HOUR)
    for bad in ("soon", "0", "-1h"):
        monkeypatch.setenv(platforms.KAGGLE_LIFETIME_ENV, bad)
        with pytest.raises(ResumableError, match=f"{platforms.KAGGLE_LIFETIME_ENV}=.*write e.g. 9h"):
            platforms.hosted()
    monkeypatch.delenv(platforms.KAGGLE_LIFETIME_ENV)
    assert session_budget(RunOptions(time_limit="1h")).limit_s == HOUR  # a --time-limit still wins


def test_the_container_age_is_counted_from_process_1() -> None:
    age = platforms.container_age_s()
    assert age is None or 0 <= age <= (platforms.vm_uptime_s() or 0) + 1


def test_resumable_train_puts_its_default_run_dir_under_kaggle_working(
        kaggle: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # a script started outside /kaggle/working
    assert MnistTraining({}).location().path == str(kaggle / TrainConfig.run_dir)
    assert MnistTraining({"run_dir": "elsewhere"}).location().path == "elsewhere"  # given: kept
    monkeypatch.chdir(kaggle)  # a notebook: its cwd is /kaggle/working, the relative default is inside it
    assert MnistTraining({}).location().path == TrainConfig.run_dir


def test_a_run_dir_outside_kaggle_working_is_warned_about(kaggle: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    for run_dir, warned in ((tmp_path / "lost", True), (kaggle / "runs" / "kept", False)):
        model = torch.nn.Linear(2, 2)
        training = Run(run_dir, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       data=TensorDataset(torch.randn(8, 2)), batch_size=4, session=Session(max_steps=1),
                       reporting=Reporting(progress=False))
        for _ in training:
            pass
        err = capsys.readouterr().err
        assert ("is outside" in err and "the only folder a saved version keeps" in err) == warned, err


def test_a_saved_version_near_its_limit_stops_with_a_committed_checkpoint(tiny_mnist: Path, tmp_path: Path) -> None:
    # A saved version ("Save & Run All") whose session limit leaves a few seconds past the margin: it trains, then
    # commits a checkpoint and exits 75 before the limit (the notebook's next cells still run and are kept).
    age = platforms.container_age_s()
    if age is None:
        pytest.skip("this system does not say when its process 1 started (/proc/1/stat)")
    limit = f"{int(age + platforms.COLAB_SAFETY_S + 8)}s"
    done = run(["--run-dir", str(tmp_path / "run"), "--data-dir", str(tiny_mnist), "--epochs", "100000", *TINY],
               KAGGLE_KERNEL_RUN_TYPE="Batch", RESUMABLE_KAGGLE_SESSION_LIMIT=limit, timeout=120)
    assert done.returncode == EXIT_RESUME, done.stderr[-2000:]
    assert re.search(r"Kaggle session detected: stopping cleanly after \d+s", done.stderr), done.stderr[-2000:]
    assert "the only folder a saved version keeps" in done.stderr  # tmp_path is not /kaggle/working
    assert newest_valid(tmp_path / "run").step > 0  # it trained, and its last state is committed


def test_the_trainer_callback_takes_the_kaggle_budget_and_a_supervisors_deadline(
        kaggle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    import time

    from resumable.integrations.transformers import ResumableCallback
    monkeypatch.setattr(platforms, "container_age_s", lambda: 3 * HOUR)
    assert ResumableCallback().budget.limit_s == pytest.approx(12 * HOUR - platforms.COLAB_SAFETY_S - 3 * HOUR)
    monkeypatch.setenv(platforms.DEADLINE_ENV, str(time.time() + HOUR))  # `resumable run --time-limit` leaves 1 h
    assert ResumableCallback().budget.limit_s == pytest.approx(HOUR, abs=5)
    assert ResumableCallback(time_limit="30m").budget.limit_s == pytest.approx(1800)
