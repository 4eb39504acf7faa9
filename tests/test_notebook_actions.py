"""The notebook actions Colab users take, in a real Jupyter kernel (ipykernel through jupyter_client): interrupt once
or twice, break, an exception, a model cell run again, a killed kernel, failures at step 0, a stuck save, a hang.
The kernel survives each, nothing keeps running behind it, and where training goes on to the end it ends with the
fingerprint and metrics of a run that was never interrupted."""

from __future__ import annotations

import fcntl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import final_fingerprint, records
from kernel import Kernel

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.faults import Faults
from resumable.reporting.history import read_sessions

# The user's notebook: a data cell, a model cell, the Run cell and the loop cell (the README's own loop, no `with`).
SETUP = """
import time
import torch, torch.nn as nn, torch.nn.functional as F
import resumable
g = torch.Generator().manual_seed(123)
X = torch.randn(512, 20, generator=g)
Y = (X[:, 0] > 0).long()
data = torch.utils.data.TensorDataset(X, Y)
"""
MODEL = """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
"""
RUN = """
run = resumable.Run(RUN_DIR, model=model, optimizer=optimizer, data=data, batch_size=16, epochs=2,
                    loader=resumable.Loader(num_workers=NUM_WORKERS), checkpointing=resumable.Checkpointing(steps=4),
                    session=resumable.Session(hang_timeout=HANG), reporting=resumable.Reporting(progress=False))
"""
LOOP = """
for epoch, step, (x, y) in run:
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    run.log(loss)
    if step == FAIL_AT:
        raise ValueError(f"planted failure at step {step}")
    if step == BREAK_AT:
        break
    if step == HANG_AT:
        time.sleep(600)
    time.sleep(DELAY)
print("finished:", run.finished, "exit code:", run.exit_code)
"""
STEPS = 64  # 512 samples / 16 a batch x 2 epochs
# What is left of a session in the kernel: resumable's session threads (the digest pool is process-wide and idle)
# and child processes (DataLoader workers).
LEFT = """
import os as _os, threading as _threading
_names = sorted(t.name for t in _threading.enumerate()
                if t.name.startswith("resumable-") and not t.name.startswith("resumable-digest"))
_children = []
for _task in _os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{_task}/children") as _f:
        _children += _f.read().split()
"""


def params(run_dir: Path, workers: int = 0, hang: str = "5m", delay: float = 0.0) -> str:
    return (f"RUN_DIR = {str(run_dir)!r}; NUM_WORKERS = {workers}; HANG = {hang!r}; DELAY = {delay}\n"
            f"FAIL_AT = BREAK_AT = HANG_AT = -1")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Kernel]]:
    """One kernel for the module's tests, as one notebook lives through many actions (a test that kills it gets
    the next one a new kernel): a kernel start and its imports cost seconds."""
    alive: list[Kernel] = [Kernel(tmp_path_factory.mktemp("kernel"))]
    yield alive
    for kernel in alive:
        kernel.shutdown()


@pytest.fixture
def notebook(kernels: list[Kernel], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    if not kernels[-1].alive():
        kernels.append(Kernel(tmp_path_factory.mktemp("kernel")))
    kernel = kernels[-1]
    yield kernel
    if kernel.alive():  # what a test planted in the kernel goes with it
        kernel.run("from resumable import faults; faults.install(faults.NO_FAULTS)")


@pytest.fixture(scope="module")
def reference(kernels: list[Kernel], tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    """The notebook run once from top to bottom, never interrupted: its final fingerprint and metrics."""
    run_dir = tmp_path_factory.mktemp("notebook-reference") / "run"
    cell = kernels[-1].run(params(run_dir) + SETUP + MODEL + RUN + LOOP)
    assert cell.done and cell.error is None and "finished: True exit code: 0" in cell.stdout, cell
    return final_fingerprint(run_dir), records(run_dir)


def plant_faults(kernel: Kernel, **faults: object) -> None:
    """Faults for the Runs the kernel builds next (the process's fault hook, as chaos's bootstrap installs it; the
    fixture removes them after)."""
    kernel.run(f"from resumable import faults; faults.install(faults.{Faults(**faults)!r})")


def assert_identical(run_dir: Path, reference: tuple[str, list]) -> None:
    assert final_fingerprint(run_dir) == reference[0]
    assert records(run_dir) == reference[1]


def committed(run_dir: Path) -> list[int]:
    return [i.step for i in CheckpointManager(checkpoints_dir(run_dir)).inspect(deep=False) if i.valid]


def wait_for(predicate, timeout: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def assert_nothing_left(kernel: Kernel, run_dir: Path) -> None:
    """No session thread, no DataLoader worker, and the run dir's lock is free (another process can take it)."""
    deadline = time.monotonic() + 5
    while True:
        kernel.run(LEFT)
        left = kernel.value("(_names, _children)")
        if left == ([], []) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == ([], []), f"left running: {left}"
    with open(run_dir / ".lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the kernel still holds it


def rerun(kernel: Kernel, run_dir: Path, reference: tuple[str, list], *cells: str) -> None:
    """Run ``cells`` (by default the Run and loop cells) again with nothing planted: training ends identical."""
    cell = kernel.run("FAIL_AT = BREAK_AT = HANG_AT = -1; DELAY = 0\n" + "".join(cells or (RUN, LOOP)))
    assert cell.done and cell.error is None and "finished: True exit code: 0" in cell.stdout, cell
    assert_identical(run_dir, reference)


def test_interrupt_once_commits_at_the_next_step_and_the_rerun_continues(
        notebook: Kernel, tmp_path: Path, reference: tuple[str, list]) -> None:
    run_dir = tmp_path / "run"
    notebook.run(params(run_dir, workers=2, delay=0.05) + SETUP + MODEL)
    pending = notebook.start(RUN + LOOP)
    wait_for(lambda: 8 in committed(run_dir))
    notebook.interrupt()  # the notebook's stop button: SIGINT to the kernel and its DataLoader workers
    cell = notebook.wait(pending)
    assert cell.done and cell.error is None, cell
    assert "finished: False exit code: 75" in cell.stdout
    assert "stopped early (SIGINT): state committed at step" in cell.stderr
    stopped = read_sessions(run_dir)[-1]
    assert stopped.ended == "SIGINT" and stopped.end_step in committed(run_dir)
    assert_nothing_left(notebook, run_dir)
    rerun(notebook, run_dir, reference)


def test_interrupt_twice_stops_at_once_and_leaves_nothing_running(
        notebook: Kernel, tmp_path: Path, reference: tuple[str, list]) -> None:
    run_dir = tmp_path / "run"
    notebook.run(params(run_dir, workers=2, delay=0.05) + SETUP + MODEL)
    pending = notebook.start("HANG_AT = 9\n" + RUN + LOOP)  # a long step 9: both interrupts land inside it
    wait_for(lambda: 8 in committed(run_dir))
    time.sleep(1.0)  # the loop is inside step 9 now
    notebook.interrupt()  # asks for a clean stop at the end of the step...
    time.sleep(0.5)
    notebook.interrupt()  # ... and this one means now
    cell = notebook.wait(pending)
    assert cell.done and cell.error is not None and cell.error[0] == "KeyboardInterrupt", cell
    assert notebook.alive()
    assert read_sessions(run_dir)[-1].ended == "interrupted (Ctrl-C)"
    assert_nothing_left(notebook, run_dir)
    rerun(notebook, run_dir, reference)


def test_break_then_idle_past_the_hang_timeout_keeps_the_kernel_and_its_variables(
        notebook: Kernel, tmp_path: Path, reference: tuple[str, list]) -> None:
    run_dir = tmp_path / "run"
    notebook.run(params(run_dir, hang="2s") + SETUP + MODEL)
    cell = notebook.run("BREAK_AT = 10\n" + RUN + LOOP)
    assert cell.done and cell.error is None, cell
    time.sleep(5)  # idle for more than twice the hang timeout: the watchdog was disarmed by the break
    assert notebook.alive() and notebook.value("step") == 10
    ended = read_sessions(run_dir)[-1]
    assert (ended.ended, ended.end_step) == ("break", 10)
    assert_nothing_left(notebook, run_dir)
    rerun(notebook, run_dir, reference)


def test_an_exception_is_recorded_and_the_fixed_rerun_is_identical(
        notebook: Kernel, tmp_path: Path, reference: tuple[str, list]) -> None:
    run_dir = tmp_path / "run"
    notebook.run(params(run_dir, hang="2s") + SETUP + MODEL)
    cell = notebook.run("FAIL_AT = 10\n" + RUN + LOOP)
    assert cell.error == ("ValueError", "planted failure at step 10"), cell
    time.sleep(3)  # past the hang timeout: the exception ended the session, the kernel lives
    assert notebook.alive()
    ended = read_sessions(run_dir)[-1]
    assert (ended.ended, ended.end_step) == ("error: ValueError", 10)
    assert "planted failure at step 10" in ended.error
    assert_nothing_left(notebook, run_dir)
    rerun(notebook, run_dir, reference)


def test_a_model_cell_run_again_after_the_run_cell_is_an_error_before_anything_stale_commits(
        notebook: Kernel, tmp_path: Path, reference: tuple[str, list]) -> None:
    run_dir = tmp_path / "run"
    notebook.run(params(run_dir) + SETUP + MODEL)
    assert notebook.run("BREAK_AT = 9\n" + RUN + LOOP).error is None  # checkpoints 4 and 8
    before = committed(run_dir)
    cell = notebook.run("BREAK_AT = -1\n" + RUN + MODEL + LOOP)  # Run, model again, loop
    assert cell.error is not None and cell.error[0] == "ResumeNotApplied", cell
    assert "re-created after the Run was built" in cell.error[1] and "Run the cell that builds the Run" in cell.error[1]
    assert committed(run_dir) == before  # nothing of the stale session committed
    assert read_sessions(run_dir)[-1].ended == "error: ResumeNotApplied"
    rerun(notebook, run_dir, reference, MODEL, RUN, LOOP)  # all cells again, in order


def test_a_killed_kernel_then_all_cells_in_a_new_kernel_is_identical(
        tmp_path: Path, reference: tuple[str, list]) -> None:
    run_dir = tmp_path / "run"
    first = Kernel(tmp_path)
    try:
        first.run(params(run_dir, delay=0.05) + SETUP + MODEL)
        first.start(RUN + LOOP)
        wait_for(lambda: 12 in committed(run_dir))
        first.kill()  # the VM went away
        assert not first.alive()
    finally:
        first.shutdown()
    second = Kernel(tmp_path)
    try:
        second.run(params(run_dir) + SETUP)
        rerun(second, run_dir, reference, MODEL, RUN, LOOP)
    finally:
        second.shutdown()
    assert read_sessions(run_dir)[0].ended is None  # the killed session: no end record


def test_four_failures_before_the_first_checkpoint_then_the_fix_trains_the_same_fresh_start(
        notebook: Kernel, tmp_path: Path, reference: tuple[str, list]) -> None:
    """No crash loop without a committed checkpoint; each failed try trained the model a few steps, and the fixed
    re-run of the Run and loop cells still starts from the state the first try was given."""
    run_dir = tmp_path / "run"
    notebook.run(params(run_dir) + SETUP + MODEL)
    for _ in range(4):
        cell = notebook.run("FAIL_AT = 2\n" + RUN + LOOP)
        assert cell.error == ("ValueError", "planted failure at step 2"), cell
    assert [s.ended for s in read_sessions(run_dir)] == ["error: ValueError"] * 4
    assert committed(run_dir) == []
    rerun(notebook, run_dir, reference)


def test_an_interrupt_during_a_stuck_save_gives_control_back_and_keeps_the_last_checkpoint(
        notebook: Kernel, tmp_path: Path, reference: tuple[str, list]) -> None:
    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    plant_faults(notebook, save_hold_file=str(hold))
    notebook.run(params(run_dir, delay=0.05) + SETUP + MODEL)
    pending = notebook.start(RUN + LOOP)
    wait_for(lambda: 8 in committed(run_dir))
    hold.touch()  # the next save gets stuck before its manifest, as on a dead mount
    wait_for(lambda: Path(f"{hold}.held").exists())
    time.sleep(1.5)  # training went on until the save after it had to wait for the stuck one
    notebook.interrupt()  # a clean stop waits for that save, for a grace; then it gives the stuck save up
    interrupted = time.monotonic()
    cell = notebook.wait(pending, timeout=60)
    assert time.monotonic() - interrupted < 30
    assert cell.done and cell.error is None and "finished: False exit code: 75" in cell.stdout, cell
    assert "interrupt again to stop at once" in cell.stderr, cell.stderr  # (tests/test_session_lifecycle.py)
    assert "the checkpoint of step 12 was still being written" in cell.stderr, cell.stderr
    assert "stopped early: a checkpoint save was stuck" in cell.stderr
    assert committed(run_dir) == [4, 8]  # the stuck save never commits
    assert_nothing_left(notebook, run_dir)
    hold.unlink()
    plant_faults(notebook)
    rerun(notebook, run_dir, reference)


def test_a_stuck_save_is_a_hang_that_ends_the_cell_not_the_kernel(notebook: Kernel, tmp_path: Path) -> None:
    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    plant_faults(notebook, save_hold_file=str(hold))
    notebook.run(params(run_dir, hang="2s", delay=0.02) + SETUP + MODEL)
    pending = notebook.start(RUN + LOOP)
    wait_for(lambda: 8 in committed(run_dir))
    hold.touch()
    cell = notebook.wait(pending, timeout=60)
    assert cell.done and cell.error is not None and cell.error[0] == "Hung", cell
    assert "a checkpoint save did not finish" in cell.error[1]
    assert notebook.alive() and committed(run_dir) == [4, 8]
    assert read_sessions(run_dir)[-1].ended == "hang"
    assert_nothing_left(notebook, run_dir)
    hold.unlink()


def test_a_hang_in_the_loop_ends_the_cell_with_an_exception_and_the_rerun_is_identical(
        notebook: Kernel, tmp_path: Path, reference: tuple[str, list]) -> None:
    run_dir = tmp_path / "run"
    notebook.run(params(run_dir, hang="2s") + SETUP + MODEL)
    started = time.monotonic()
    cell = notebook.run("HANG_AT = 10\n" + RUN + LOOP)  # the body sleeps 10 minutes at step 10
    assert time.monotonic() - started < 60
    assert cell.error is not None and cell.error[0] == "Hung", cell
    assert "no optimizer step completed for" in cell.error[1]
    assert notebook.alive() and notebook.value("step") == 10
    ended = read_sessions(run_dir)[-1]
    assert ended.ended == "hang" and list(run_dir.glob("hang-*.txt"))
    assert_nothing_left(notebook, run_dir)
    rerun(notebook, run_dir, reference)
