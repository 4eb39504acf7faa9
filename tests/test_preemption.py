"""Durations, checkpoint triggers, the session budget and signal handling (unit level)."""

from __future__ import annotations

import os
import signal

import pytest
from click.testing import CliRunner

from resumable import platforms
from resumable.cli import train_command
from resumable.config import format_duration, parse_duration
from resumable.engine.loop import preemption
from resumable.engine.loop.preemption import Budget, StopFlag
from resumable.engine.loop.triggers import SaveTriggers, young_interval


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("5m", 300), ("1h30m", 5400), ("2h", 7200),
                                           ("45", 45), ("1.5m", 90), ("1h0m5s", 3605), (" 10S ", 10)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5x", "m", "10m5", "-5s", "0s", "1h1h", "abc"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_format_duration_round_trips() -> None:
    for seconds in (30, 90, 5400, 3605, 43200):
        assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize("option, value", [("--checkpoint-every", "5x"), ("--time-limit", "soon"),
                                           ("--mtbf", "0s"), ("--checkpoint-every", "")])
def test_bad_duration_options_exit_2(tmp_path, option: str, value: str) -> None:
    result = CliRunner().invoke(train_command, ["--run-dir", str(tmp_path / "r"), option, value])
    assert result.exit_code == 2 and option in result.output
    assert not (tmp_path / "r").exists()


def test_young_interval_and_bounds() -> None:
    assert young_interval(2.0, 3600) == pytest.approx(120.0)
    assert young_interval(0.001, 3600) == 30.0
    assert young_interval(1000.0, 36000) == 1800.0


def test_triggers() -> None:
    t = SaveTriggers(every_steps=None, every_s=10.0, now=0.0)
    assert t.due(1, now=9.9) is None and t.due(2, now=10.0) == "time"
    t.saved(0.01, now=10.0)
    assert t.due(3, now=15.0) is None
    auto = SaveTriggers(every_steps=None, every_s=None, auto_mtbf_s=3600.0, now=0.0)
    assert auto.every_s == 30.0
    assert auto.saved(2.0, now=1.0) == pytest.approx(120.0)
    assert auto.due(5, now=100.0) is None and auto.due(6, now=121.0) == "time"


def test_budget_leaves_room_for_step_and_save() -> None:
    budget = Budget(10.0, start=0.0, margin=1.5, floor_s=1.0)
    assert budget.fits(step_s=1.0, save_s=1.0, now=5.0)  # 5 left > (1+1)*1.5+1
    assert not budget.fits(step_s=1.0, save_s=1.0, now=6.5)
    assert Budget(None).fits(1e9, 1e9)


def test_colab_budget_counts_from_vm_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert platforms.colab_default_limit_s() is None
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab-test")
    monkeypatch.setattr(platforms, "vm_uptime_s", lambda: 3 * 3600.0)
    expected = 12 * 3600 - platforms.COLAB_SAFETY_S - 3 * 3600
    assert platforms.colab_default_limit_s() == pytest.approx(expected)


def test_stop_flag_sets_flag_second_sigint_interrupts_and_restores() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    with StopFlag() as flag:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.requested == "SIGUSR1"
    with StopFlag() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.requested == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert {s: signal.getsignal(s) for s in before} == before


def test_process_age_is_plausible() -> None:
    age = preemption.process_age_s()
    assert 0.0 < age < 24 * 3600


def test_auto_interval_is_announced(tiny_mnist, tmp_path) -> None:
    result = CliRunner().invoke(train_command, ["--run-dir", str(tmp_path), "--data-dir", str(tiny_mnist),
                                                "--batch-size", "16", "--epochs", "3", "--checkpoint-every", "auto",
                                                "--no-progress"])
    assert result.exit_code == 0, result.output
    assert result.output.count("--checkpoint-every auto:") == 1
    assert "checkpoint every 30s" in result.output  # tiny saves: Young's interval hits the 30 s floor
    assert "checkpoint(s), training blocked" in result.output
