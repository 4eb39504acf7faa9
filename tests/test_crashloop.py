"""Crash-loop detection (exit 77 before training) and --resume-from STEP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import final_fingerprint

from resumable.cli import train_command
from resumable.engine.crashloop import crash_loop
from resumable.errors import EXIT_CRASH_LOOP
from resumable.reporting.history import SessionRecord, read_sessions

ARGS = ["--batch-size", "16", "--epochs", "3", "--checkpoint-steps", "4", "--log-every", "1", "--no-progress",
        "--no-download"]


def invoke(run_dir: Path, data: Path, *extra: str):
    return CliRunner().invoke(train_command, ["--run-dir", str(run_dir), "--data-dir", str(data), *ARGS, *extra])


def session(number: int, start: int, ended: str | None) -> SessionRecord:
    return SessionRecord(number, 0.0, start, start or None, end_step=None if ended is None else start + 1, ended=ended)


def test_what_makes_a_crash_loop() -> None:
    failing = [session(2, 8, "error: RuntimeError"), session(3, 8, None), session(4, 8, "hang")]
    assert crash_loop(failing, 8) == failing  # an exception, a kill, a hang: all from step 8
    assert crash_loop(failing, 4) is None  # this start resumes from another step (--resume-from 4)
    assert crash_loop(failing[1:], 8) is None  # only 2 sessions
    assert crash_loop([session(1, 0, None), *failing[1:]], 8) is None  # the first one made progress from step 0
    for stop in ("SIGTERM", "time limit", "interrupted (Ctrl-C)", "finished"):  # stopped on purpose: no failure
        assert crash_loop([*failing[:2], session(4, 8, stop)], 8) is None


def test_a_crash_loop_needs_the_same_code_and_config() -> None:
    def failed(number: int, code: str = "c1", config: str = "o1") -> SessionRecord:
        return SessionRecord(number, 0.0, 8, 8, end_step=9, ended="error: NameError", code=code, config=config)

    same = [failed(2), failed(3), failed(4)]
    assert crash_loop(same, 8, "c1", "o1") == same
    assert crash_loop(same, 8, "c2", "o1") is None  # the script (or notebook cell) was changed: a new attempt
    assert crash_loop(same, 8, "c1", "o2") is None  # an option was changed
    assert crash_loop([failed(2, code="c0"), failed(3), failed(4)], 8, "c1", "o1") is None  # a fix in between
    assert crash_loop([failed(2, code=None), failed(3), failed(4)], 8, "c1", "o1") is None  # a record of before


def test_failures_before_any_checkpoint_never_make_a_crash_loop(tiny_mnist: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Debugging a script: every try fails before its first checkpoint, and the next one still starts."""
    monkeypatch.setenv("RESUMABLE_FAULTS", json.dumps({"raise_at_step": 1}))
    for _ in range(4):
        failed = invoke(tmp_path, tiny_mnist)
        assert isinstance(failed.exception, RuntimeError), failed.output
    assert [s.start_step for s in read_sessions(tmp_path)] == [0, 0, 0, 0]
    monkeypatch.delenv("RESUMABLE_FAULTS")  # the typo is fixed
    assert invoke(tmp_path, tiny_mnist, "--max-steps", "4").exit_code == 0


def test_a_changed_option_starts_a_new_count(tiny_mnist: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESUMABLE_FAULTS", json.dumps({"raise_at_step": 9}))
    for _ in range(4):  # session 1 commits up to step 8, sessions 2-4 fail from it
        assert isinstance(invoke(tmp_path, tiny_mnist).exception, RuntimeError)
    assert invoke(tmp_path, tiny_mnist).exit_code == EXIT_CRASH_LOOP
    changed = invoke(tmp_path, tiny_mnist, "--log-every", "2")  # another config: not the same failure again
    assert isinstance(changed.exception, RuntimeError) and "planted failure at step 9" in str(changed.exception)


def test_always_failing_step_stops_the_next_start(tiny_mnist: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESUMABLE_FAULTS", json.dumps({"raise_at_step": 9}))
    for _ in range(4):  # session 1 commits steps 4, 6, 8 (progress), sessions 2-4 all fail from step 8
        result = invoke(tmp_path, tiny_mnist)
        assert isinstance(result.exception, RuntimeError) and "planted failure at step 9" in str(result.exception)
    ends = read_sessions(tmp_path)
    assert [s.start_step for s in ends] == [0, 8, 8, 8]
    assert ends[-1].ended == "error: RuntimeError" and "planted failure at step 9" in ends[-1].error
    refused = invoke(tmp_path, tiny_mnist)
    assert refused.exit_code == EXIT_CRASH_LOOP, refused.output
    message = " ".join(refused.output.split())
    assert "started from step 8" in message and "RuntimeError: planted failure at step 9" in message
    assert "--resume-from STEP" in message and "steps available: 4, 6" in message and "--ignore-crash-loop" in message
    assert "a changed script, notebook cell or option starts a new count" in message
    assert len(read_sessions(tmp_path)) == 4  # the refused start wrote nothing
    monkeypatch.delenv("RESUMABLE_FAULTS")  # the cause is fixed
    assert invoke(tmp_path, tiny_mnist, "--ignore-crash-loop").exit_code == 0


def test_resume_from_an_older_step_sets_newer_ones_aside_and_trains_on(tiny_mnist: Path, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert invoke(reference, tiny_mnist).exit_code == 0
    run_dir = tmp_path / "run"
    assert invoke(run_dir, tiny_mnist, "--max-steps", "8").exit_code == 0  # checkpoints 4, 6, 8
    unknown = invoke(run_dir, tiny_mnist, "--resume-from", "5")
    assert unknown.exit_code == 2 and "valid checkpoint steps: 4, 6, 8" in unknown.output
    result = invoke(run_dir, tiny_mnist, "--resume-from", "4", "--max-steps", "18")
    assert result.exit_code == 0, result.output
    aside = list((run_dir / "set-aside").iterdir())
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step-000000006", "step-000000008"]
    assert final_fingerprint(run_dir) == final_fingerprint(reference)
    assert read_sessions(run_dir)[-1].start_step == 4
