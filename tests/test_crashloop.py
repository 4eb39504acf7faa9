"""Crash-loop detection (exit 77 before training) and --resume-from STEP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import final_fingerprint, policies

from resumable import Run, faults
from resumable.cli import train_command
from resumable.engine.rundir.crash_loop import crash_loop
from resumable.engine.session import open_runs
from resumable.errors import EXIT_CRASH_LOOP, CrashLoop
from resumable.faults import Faults
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


def _tiny(run_dir: Path, fail_at: int | None, **options) -> Run:  # noqa: ANN003
    """A tiny Run whose loop raises at step ``fail_at`` (None: it trains to the end)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    run = Run(run_dir, model=model, optimizer=optimizer, data=data, batch_size=8, epochs=1,
              **policies(progress=False, checkpoint_steps=4, **options))
    for _epoch, step, (x, y) in run:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step == fail_at:
            raise RuntimeError(f"planted failure at step {step}")
    return run


def _failing(run_dir: Path, fail_at: int, **options) -> None:  # noqa: ANN003
    with pytest.raises(RuntimeError, match="planted failure") as caught:
        _tiny(run_dir, fail_at, **options)
    open_runs.loop_ended(caught.value)  # what Python reports at the top of a script (here pytest.raises caught it)


def test_failures_before_any_checkpoint_never_make_a_crash_loop(tmp_path: Path) -> None:
    """Debugging: every try fails before its first checkpoint, and the next one still starts."""
    for _ in range(4):
        _failing(tmp_path, 1)
    assert [s.start_step for s in read_sessions(tmp_path)] == [0, 0, 0, 0]
    assert _tiny(tmp_path, None).finished  # the typo is fixed


def test_a_changed_option_starts_a_new_count(tmp_path: Path) -> None:
    for _ in range(4):  # session 1 commits step 4, sessions 2-4 fail from it with the same code and options
        _failing(tmp_path, 5)
    with pytest.raises(CrashLoop, match="ran this same code and config"):
        _tiny(tmp_path, 5)
    _failing(tmp_path, 5, log_every=2)  # another option: a new attempt, not the same failure again
    digests = {(s.code, s.config) for s in read_sessions(tmp_path)}
    assert len(digests) == 2 and all(code and config for code, config in digests)


def test_always_failing_step_stops_the_next_start(tiny_mnist: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_INSTALLED", Faults(raise_at_step=9))  # the hook, as chaos's bootstrap sets it
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
    monkeypatch.setattr(faults, "_INSTALLED", None)  # the cause is fixed
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
