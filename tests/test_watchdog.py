"""The step watchdog: the auto timeout, what pauses it, and a planted hang in a real process (exit 76, stacks on
disk, the committed checkpoint intact, and a resume that ends bit-identical to an uninterrupted run)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import command, env, final_fingerprint, inspect_json, records

from resumable.cli import train_command
from resumable.engine.loop.watchdog import (
    FIRST_STEP_S,
    FLOOR_S,
    MIN_SAMPLES,
    SAVE_FACTOR,
    Overdue,
    Watchdog,
    default_timeout,
)
from resumable.errors import EXIT_HANG
from resumable.faults import Faults

ARGS = ["--batch-size", "16", "--epochs", "3", "--checkpoint-steps", "2", "--log-every", "1", "--no-progress",
        "--no-download"]


def test_default_timeout_from_measured_step_times() -> None:
    assert default_timeout([]) == FLOOR_S
    assert default_timeout([100.0] * (MIN_SAMPLES - 1)) == FLOOR_S  # too few steps measured: the floor only
    assert default_timeout([0.05] * 1000) == FLOOR_S  # fast steps: never below 5 minutes
    assert default_timeout([60.0] * 100) == 600.0  # 10 x p99
    # the p99 of 100 steps ignores the single slowest one, not two
    assert default_timeout([1.0] * 98 + [40.0, 50.0]) == 400.0


def test_first_step_allowance_pauses_and_beats() -> None:
    now = [0.0]
    fired: list[tuple[int, float, float]] = []
    dog = Watchdog(2.0, lambda *hung: fired.append(hung), clock=lambda: now[0])
    dog._last, dog._step = 0.0, 10  # armed after step 10 (start() without its thread)
    assert dog.limit() == FIRST_STEP_S  # the first step (compile, workers starting) gets at least 15 minutes
    now[0] = 100.0
    assert dog.overdue() is None
    dog.beat(11)
    assert dog.limit() == 2.0
    with dog.paused():  # evaluation: not counted
        now[0] = 1000.0
        assert dog.overdue() is None
    now[0] = 1001.5  # the clock restarted when the pause ended
    assert dog.overdue() is None
    now[0] = 1003.0
    assert dog.overdue() == Overdue(11, 3.0, 2.0, "step")


def test_saves_are_watched_against_their_own_bound_and_idle_loops_not_at_all() -> None:
    now, slowest = [0.0], [0.0]
    dog = Watchdog(2.0, lambda *hung: None, clock=lambda: now[0], slowest_save=lambda: slowest[0])
    dog.beat(5)
    assert dog.save_limit() == 2.0  # no save measured yet: the hang timeout
    slowest[0] = 0.5
    assert dog.save_limit() == SAVE_FACTOR * 0.5  # 10x the slowest save so far, when that is longer
    with dog.saving():  # a save stuck on a dead mount is a hang like any other
        now[0] = 4.9
        assert dog.overdue() is None
        now[0] = 5.5
        assert dog.overdue() == Overdue(5, 5.5, 5.0, "save")
    now[0] = 6.0  # the step clock restarted after the save
    assert dog.overdue() is None
    dog.idle()  # control is outside the loop (a notebook cell ended with it suspended): nothing is watched
    now[0] = 1000.0
    assert dog.overdue() is None
    dog.wake()  # the loop runs again: the step's clock starts now
    now[0] = 1001.0
    assert dog.overdue() is None
    now[0] = 1002.5
    assert dog.overdue() == Overdue(5, 2.5, 2.0, "step")


def _train(run_dir: Path, data: Path, *extra: str, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command() + ["--run-dir", str(run_dir), "--data-dir", str(data), *ARGS, *extra],
                          capture_output=True, text=True, timeout=240, env=env(**extra_env), stdin=subprocess.DEVNULL)


def _invoke(run_dir: Path, data: Path, *extra: str):
    return CliRunner().invoke(train_command, ["--run-dir", str(run_dir), "--data-dir", str(data), *ARGS, *extra])


def test_planted_hang_exits_76_with_stacks_and_resumes_identically(tiny_mnist: Path, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert _invoke(reference, tiny_mnist).exit_code == 0
    run_dir = tmp_path / "run"
    hung = _train(run_dir, tiny_mnist, "--hang-timeout", "2s", **Faults(hang_at_step=5).to_env())
    assert hung.returncode == EXIT_HANG, hung.stderr
    stacks = list(run_dir.glob("hang-*-0.txt"))
    assert [p.name for p in stacks] == ["hang-1-0.txt"]
    assert f"thread stacks in {stacks[0]}" in hung.stderr and "after step 5" in hung.stderr
    text = stacks[0].read_text()
    assert "Thread MainThread" in text and "in _hang" in text and "in after_step" in text  # where it hung
    assert inspect_json(run_dir)["latest_valid"]["step"] == 4  # the last committed checkpoint is valid
    ends = [json.loads(line) for line in (run_dir / "sessions.jsonl").read_text().splitlines()]
    assert ends[-1]["event"] == "end" and ends[-1]["ended"] == "hang" and "after step 5" in ends[-1]["error"]
    resumed = _invoke(run_dir, tiny_mnist)  # the same command (a supervisor's restart), without the fault
    assert resumed.exit_code == 0, resumed.output
    assert final_fingerprint(run_dir) == final_fingerprint(reference)
    assert records(run_dir) == records(reference)


@pytest.mark.parametrize("value", ["0s", "soon", "-1m"])
def test_bad_hang_timeout_is_a_usage_error(tmp_path: Path, value: str) -> None:
    result = CliRunner().invoke(train_command, ["--run-dir", str(tmp_path / "r"), "--hang-timeout", value])
    assert result.exit_code == 2 and "--hang-timeout" in result.output
