"""How a session begins and ends inside one process, as a notebook kernel lives it (in this process, without a
kernel; tests/test_notebook_actions.py drives a real one): a Run cell run again while the old loop is open, the
objects that train are the objects saved, the same fresh start after a failed try, quiet output."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import final_fingerprint, policies

from resumable import Run
from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.engine.run import ToolHooks
from resumable.engine.session import notebook
from resumable.errors import ResumableError, ResumeNotApplied, StopNow
from resumable.faults import Faults, held_marker
from resumable.reporting.history import read_sessions


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.utils.data.Dataset]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    generator = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=generator),
                                          torch.randint(0, 2, (64,), generator=generator))
    return model, torch.optim.Adam(model.parameters(), lr=0.01), data


def make_run(run_dir: Path, model, optimizer, data, faults: Faults | None = None, **options) -> Run:  # noqa: ANN001
    defaults = {"batch_size": 8, "epochs": 2, "progress": False, "checkpoint_steps": 4}
    run = Run(run_dir, model=model, optimizer=optimizer, data=data, **policies(**{**defaults, **options}))
    return run._for_tool(ToolHooks(faults=faults)) if faults is not None else run


def train(run: Run, model, optimizer, fail_at: int = -1) -> Run:  # noqa: ANN001
    for _epoch, step, (x, y) in run:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == fail_at:
            raise ValueError(f"planted failure at step {step}")
    return run


def session_threads(before: set[threading.Thread]) -> list[str]:
    """resumable's session threads started since ``before`` was taken (the digest pool is process-wide and idle)."""
    return sorted(t.name for t in threading.enumerate() if t not in before
                  and t.name.startswith("resumable-") and not t.name.startswith("resumable-digest"))


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> str:
    run_dir = tmp_path_factory.mktemp("clean")
    model, optimizer, data = build()
    assert train(make_run(run_dir, model, optimizer, data), model, optimizer).finished
    return final_fingerprint(run_dir)


def test_a_run_cell_run_again_releases_the_open_run_and_continues(tmp_path: Path, clean: str) -> None:
    model, optimizer, data = build()
    before = set(threading.enumerate())
    old = make_run(tmp_path, model, optimizer, data)
    held = iter(old)  # a loop kept open (an iterator in a variable): its session, lock and threads are live
    for _ in range(6):
        _epoch, _step, (x, y) = next(held)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert "resumable-lock" in session_threads(before)
    new = make_run(tmp_path, model, optimizer, data)  # the Run cell again: the old one is closed here
    assert session_threads(before) == [] and held.gi_frame is None
    assert read_sessions(tmp_path)[-1].ended == "closed: a new Run on its run dir"
    assert train(new, model, optimizer).finished  # resumed from the old session's step 4 checkpoint
    assert new.resumed_from == 4 and final_fingerprint(tmp_path) == clean


def test_a_rebuilt_model_and_optimizer_are_refused_before_anything_commits(tmp_path: Path) -> None:
    model, optimizer, data = build()
    run = make_run(tmp_path, model, optimizer, data, checkpoint_steps=1)
    model, optimizer, _ = build()  # the model cell run again after the Run cell
    with pytest.raises(ResumeNotApplied, match="re-created after the Run was built"):
        train(run, model, optimizer)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    assert read_sessions(tmp_path)[-1].ended == "error: ResumeNotApplied"


def test_a_rebuilt_model_alone_is_refused_too(tmp_path: Path) -> None:
    model, optimizer, data = build()
    run = make_run(tmp_path, model, optimizer, data, checkpoint_steps=1)
    model = build()[0]  # the Run's optimizer now holds parameters that get no gradient
    with pytest.raises(ResumeNotApplied, match="none of its parameters had a gradient"):
        train(run, model, optimizer)


def test_a_step_that_no_optimizer_takes_is_not_judged(tmp_path: Path) -> None:
    """A GradScaler skipping an overflow steps nothing: no proof either way, no error."""
    model, optimizer, data = build()
    run = make_run(tmp_path, model, optimizer, data, max_steps=6)
    for _epoch, step, (x, y) in run:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if step % 2:
            optimizer.step()
    assert run.finished


def test_a_second_fresh_start_on_objects_an_earlier_try_changed(tmp_path: Path, clean: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer, data = build()
    with pytest.raises(ValueError, match="planted"):
        train(make_run(tmp_path / "script", model, optimizer, data), model, optimizer, fail_at=2)
    # Outside a kernel nothing was copied: a fresh start from the changed objects is refused, naming the fix.
    with pytest.raises(ResumableError, match="Run the cell that builds the model and optimizer again"):
        train(make_run(tmp_path / "script", model, optimizer, data), model, optimizer)
    # In a kernel the first fresh start keeps a copy, and the fixed try starts from it: the clean run's result.
    monkeypatch.setattr(notebook, "interactive", lambda: True)
    model, optimizer, data = build()
    for _ in range(2):
        with pytest.raises(ValueError, match="planted"):
            train(make_run(tmp_path / "kernel", model, optimizer, data), model, optimizer, fail_at=2)
    assert train(make_run(tmp_path / "kernel", model, optimizer, data), model, optimizer).finished
    assert final_fingerprint(tmp_path / "kernel") == clean
    # New objects (the model cell run again) are a fresh start of their own.
    model, optimizer, data = build(seed=1)
    assert train(make_run(tmp_path / "other", model, optimizer, data), model, optimizer).finished


def test_quiet_keeps_warnings_errors_and_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, optimizer, data = build()
    train(make_run(tmp_path, model, optimizer, data, max_steps=6, quiet=True), model, optimizer)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] + ": " + line.split(": ")[1][:10] for line in lines] == [
        "resumable: 2 checkpoi", "resumable: done at st"], lines
    train(make_run(tmp_path / "loud", model, optimizer, data, max_steps=6), model, optimizer)
    err = capsys.readouterr().err
    assert "training on cpu" in err and "CUBLAS" not in err  # no GPU-only line on a CPU run


@pytest.mark.parametrize(("signame", "raised", "ended"), [("SIGINT", KeyboardInterrupt, "interrupted (Ctrl-C)"),
                                                          ("SIGTERM", StopNow, "SIGTERM (at once)")])
def test_a_second_stop_signal_during_a_stuck_save_stops_at_once(tmp_path: Path, signame: str, raised: type,
                                                                 ended: str) -> None:
    hold = tmp_path / "hold"
    model, optimizer, data = build()
    before = set(threading.enumerate())
    run = make_run(tmp_path / "run", model, optimizer, data, faults=Faults(save_hold_file=str(hold)))
    signum = getattr(signal, signame)

    def stop_twice() -> None:  # once the save of step 12 is stuck and the next save waits for it
        while not Path(held_marker(hold)).exists():
            time.sleep(0.01)
        time.sleep(0.5)
        os.kill(os.getpid(), signum)  # asks for a clean stop, which would wait for the stuck save
        time.sleep(0.3)
        os.kill(os.getpid(), signum)  # the second: now

    def body(step: int) -> None:
        if step == 10:
            while not (checkpoints_dir(tmp_path / "run") / "step-000000008" / "manifest.json").exists():
                time.sleep(0.01)  # the save of step 8 is committed; the next one (step 12) gets stuck
            hold.touch()  # before its manifest, as on a dead mount
            threading.Thread(target=stop_twice, daemon=True).start()

    started = time.monotonic()
    with pytest.raises(raised):
        for _epoch, step, (x, y) in run:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            body(step)
    assert time.monotonic() - started < 20
    assert [i.step for i in CheckpointManager(checkpoints_dir(tmp_path / "run")).inspect() if i.valid] == [4, 8]
    assert read_sessions(tmp_path / "run")[-1].ended == ended
    deadline = time.monotonic() + 5  # the given-up save sees it and ends without committing
    while session_threads(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert session_threads(before) == []
    hold.unlink()
