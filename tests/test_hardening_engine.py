"""Issue #17, the engine's part: sessions finalised where an exception passes, failures that clean up after
themselves, record writes that never stop training, signals during start-up, a closed stderr, a dataset that
grew. Each test failed on the code before its fix."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import command, env, policies

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.checkpoint import format as fmt
from resumable.errors import ResumableError
from resumable.reporting.history import read_sessions

TESTS = Path(__file__).parent


def tiny_run(run_dir: Path, size: int = 40, **options):
    from resumable import Run

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(size, 4), torch.randint(0, 2, (size,)))
    defaults = {"batch_size": 8, "epochs": 2, "progress": False}
    return Run(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data,
               **policies(run_dir=run_dir, **{**defaults, **options}))


def train(run, body=None):
    for epoch, step, (x, y) in run:
        loss = torch.nn.functional.cross_entropy(run.model(x), y)
        run.optimizer.zero_grad()
        loss.backward()
        run.optimizer.step()
        if body is not None:
            body(run, epoch, step)
    return run


def leftovers(run_dir: Path) -> list[str]:
    """Temp files and step dirs without a manifest under the run's checkpoints."""
    root = checkpoints_dir(run_dir)
    found = [p.name for p in root.rglob("*") if fmt.TMP_MARK in p.name]
    found += [p.name for p in root.iterdir() if p.is_dir() and not (p / fmt.MANIFEST).exists()]
    return found


# -- an exception in the loop body ---------------------------------------------------------------------------
_BODIES = {
    "raise in a for loop": ("for epoch, step, batch in run:\n    if step == 5:\n        raise ZeroDivisionError\n",
                            "error: ZeroDivisionError"),
    "raise inside with run": ("with run:\n    for epoch, step, batch in run:\n        if step == 5:\n"
                              "            raise ValueError('bad batch')\n", "error: ValueError"),
    "Ctrl-C in the body": ("for epoch, step, batch in run:\n    if step == 5:\n        raise KeyboardInterrupt\n",
                           "interrupted (Ctrl-C)"),
    "break, then the script ends": ("for epoch, step, batch in run:\n    if step == 5:\n        break\n",
                                    "break"),
    "raise after a break, elsewhere": ("for epoch, step, batch in run:\n    if step == 5:\n        break\n"
                                       "raise ValueError('not the loop')\n", "break"),
}


@pytest.mark.parametrize("case", list(_BODIES))
def test_an_exception_in_the_loop_body_is_recorded_where_it_passes(tmp_path: Path, case: str) -> None:
    body, ended = _BODIES[case]
    script = tmp_path / "train.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(TESTS)!r})\nfrom test_hardening_engine import tiny_run\n"
                      f"run = tiny_run({str(tmp_path / 'run')!r}, checkpoint_steps=2)\n{body}")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env())
    assert "Exception ignored" not in done.stderr and "NameError" not in done.stderr, done.stderr[-2000:]
    sessions = read_sessions(tmp_path / "run")
    assert [(s.end_step, s.ended) for s in sessions] == [(5, ended)], done.stderr[-2000:]


def test_a_script_that_breaks_out_and_works_on_is_not_killed_by_the_watchdog(tmp_path: Path) -> None:
    """The loop left by break ends its session at once: the watchdog is disarmed, the run dir released."""
    script = tmp_path / "train.py"
    script.write_text(f"import sys, time; sys.path.insert(0, {str(TESTS)!r})\n"
                      f"from test_hardening_engine import tiny_run\n"
                      f"run = tiny_run({str(tmp_path / 'run')!r}, hang_timeout='1s')\n"
                      f"for epoch, step, batch in run:\n    if step == 3:\n        break\n"
                      f"time.sleep(3)  # evaluation, plotting... for longer than the hang timeout\n"
                      f"again = tiny_run({str(tmp_path / 'run')!r})  # the run dir is free\n"
                      f"print('trained on to', [s for _, s, _ in again][-1])\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained on to 9" in done.stdout
    assert [s.ended for s in read_sessions(tmp_path / "run")] == ["break", "finished"]


# -- signals during start-up, SIGHUP, a closed stderr ---------------------------------------------------------
def _start(run_dir: Path, data: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(command() + ["--run-dir", str(run_dir), "--data-dir", str(data), "--batch-size", "8",
                                         "--epochs", "50", "--no-progress", "--no-download", *extra],
                            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def _wait_until_caught(pid: int, signum: int, timeout: float = 60.0) -> None:
    """Until ``pid`` has a handler for ``signum`` (its SigCgt mask in /proc), so the signal is sent during
    start-up but never before the entry point installed its handlers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            break
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught & (1 << (signum - 1)):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} never installed a handler for signal {signum}")


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_during_start_up_is_a_clean_stop(tiny_mnist: Path, tmp_path: Path, name: str) -> None:
    proc = _start(tmp_path, tiny_mnist)
    # Python itself catches SIGINT from the start; SIGHUP only once resumable's start-up handlers are in place.
    _wait_until_caught(proc.pid, signal.SIGHUP)  # torch is still importing then
    proc.send_signal(getattr(signal, name))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-2000:]
    assert "Traceback" not in stderr and "training on" in stderr
    latest, _ = CheckpointManager(checkpoints_dir(tmp_path)).latest_valid()
    assert latest is not None, "the stop committed the state"


def _wait_training(proc: subprocess.Popen) -> None:
    for line in proc.stderr:
        if "training on" in line:
            return
    raise AssertionError("training never started")


def test_sighup_stops_like_sigterm(tiny_mnist: Path, tmp_path: Path) -> None:
    proc = _start(tmp_path, tiny_mnist)
    _wait_training(proc)
    time.sleep(0.5)
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75 and "stopped early (SIGHUP)" in stderr, stderr[-2000:]


def test_sigterm_after_the_reader_of_stderr_went_away(tiny_mnist: Path, tmp_path: Path) -> None:
    proc = _start(tmp_path, tiny_mnist)
    _wait_training(proc)
    proc.stderr.close()  # like `resumable-train ... 2>&1 | head` once head has exited
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 75
    ended = read_sessions(tmp_path)[-1]
    latest, _ = CheckpointManager(checkpoints_dir(tmp_path)).latest_valid()
    assert ended.ended == "SIGTERM" and latest.step == ended.end_step, \
        "the stop committed its state although nobody reads the messages"


# -- failures that clean up after themselves -----------------------------------------------------------------
def test_a_disk_full_for_a_while_leaves_no_temp_files_and_the_next_save_succeeds(tmp_path: Path,
                                                                                monkeypatch) -> None:
    from resumable.checkpoint import state_format

    real = fmt.write_bytes_atomic
    calls = {"n": 0}

    def full_for_a_while(directory: Path, data: bytes, name: str):
        calls["n"] += 1
        if 2 <= calls["n"] <= 4:  # three saves in a row hit a full disk, half-way through their payload
            (directory / f".{name}{fmt.TMP_MARK}{os.getpid()}").write_bytes(b"x" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(directory, data, name)

    monkeypatch.setattr(state_format.fmt, "write_bytes_atomic", full_for_a_while)
    run = train(tiny_run(tmp_path, checkpoint_steps=1, sync_checkpoints=True))
    assert calls["n"] > 4 and run.finished and leftovers(tmp_path) == []
    latest, _ = CheckpointManager(checkpoints_dir(tmp_path)).latest_valid()
    assert latest.step == 10


def _fail_with(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


_RECORD_FAULTS = {
    "sessions.jsonl EIO": ("resumable.reporting.history.SessionLog._append", errno.EIO),
    "metrics.jsonl EIO": ("resumable.reporting.metrics.MetricsLog.log", errno.EIO),
    "metrics fsync EIO": ("resumable.reporting.metrics.MetricsLog.sync", errno.EIO),
    "lock release on a read-only remount": ("resumable.engine.rundir.lock.RunLock.release", errno.EROFS),
}


@pytest.mark.parametrize("case", list(_RECORD_FAULTS))
def test_a_record_that_cannot_be_written_never_stops_training(tmp_path: Path, monkeypatch, capsys,
                                                              case: str) -> None:
    target, code = _RECORD_FAULTS[case]
    monkeypatch.setattr(target, _fail_with(code))
    run = train(tiny_run(tmp_path, checkpoint_steps=3))
    assert run.finished and run.exit_code == 0
    latest, _ = CheckpointManager(checkpoints_dir(tmp_path)).latest_valid()
    assert latest.step == 10, "every checkpoint was still written"
    assert "warning:" in capsys.readouterr().err


def test_a_run_dir_emptied_under_a_live_run_does_not_end_in_done(tmp_path: Path, monkeypatch) -> None:
    real = CheckpointManager.commit  # what the engine calls once a save's files are written

    def commit_then_lose_it(self, step, files, meta, **options):
        info = real(self, step, files, meta, **options)
        if step == 10:  # the final checkpoint commits, then someone deletes the run's checkpoints
            shutil.rmtree(self.root)
        return info

    monkeypatch.setattr(CheckpointManager, "commit", commit_then_lose_it)
    run = train(tiny_run(tmp_path, checkpoint_steps=4, max_steps=10))
    assert not run.finished and run.exit_code == 75 and run.outcome.reason == "checkpoint missing"


def test_no_room_for_another_checkpoint_at_start_is_exit_2_and_changes_nothing(tmp_path: Path,
                                                                               monkeypatch) -> None:
    train(tiny_run(tmp_path, max_steps=4))
    before = (tmp_path / "sessions.jsonl").read_bytes(), sorted(p.name for p in checkpoints_dir(tmp_path).iterdir())
    from resumable.engine.state import room

    real = shutil.disk_usage
    monkeypatch.setattr(room.shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    with pytest.raises(ResumableError, match="MB free and a checkpoint needs") as caught:
        train(tiny_run(tmp_path))
    assert caught.value.exit_code == 2
    after = (tmp_path / "sessions.jsonl").read_bytes(), sorted(p.name for p in checkpoints_dir(tmp_path).iterdir())
    assert after == before


def test_a_full_disk_at_start_is_exit_2_with_the_cause(tmp_path: Path, monkeypatch) -> None:
    from resumable.engine.rundir import lock

    monkeypatch.setattr(lock.RunLock, "acquire", _fail_with(errno.ENOSPC))
    with pytest.raises(ResumableError, match="No space left on device") as caught:
        train(tiny_run(tmp_path / "run"))
    assert caught.value.exit_code == 2 and not (tmp_path / "run").exists()


# -- a dataset that grew between sessions --------------------------------------------------------------------
def test_a_grown_dataset_is_taken_at_an_epoch_boundary_with_allow_data_change(tmp_path: Path) -> None:
    train(tiny_run(tmp_path, size=40, max_steps=5))  # one epoch of 5 steps, saved at its end
    with pytest.raises(ResumableError, match="allow_data_change=True"):
        train(tiny_run(tmp_path, size=48))
    grown = train(tiny_run(tmp_path, size=48, allow_data_change=True))
    assert grown.finished and grown.resumed_from == 5 and grown.state.step == 11  # epoch 2 has 6 steps
    starts = [json.loads(line) for line in (tmp_path / "sessions.jsonl").read_text().splitlines()]
    assert [r.get("note") for r in starts if r["event"] == "start"][-1] == ("dataset changed from 40 to 48 samples "
                                                                            "(allow_data_change)")
    mid = tmp_path / "mid"
    train(tiny_run(mid, size=40, max_steps=3))  # stopped mid-epoch
    with pytest.raises(ResumableError, match="epoch boundary only"):
        train(tiny_run(mid, size=48, allow_data_change=True))


@pytest.mark.parametrize(("name", "make"), [("checkpoints", "file"), ("metrics.jsonl", "dir"),
                                            ("sessions.jsonl", "dir"), ("tensorboard", "file")])
def test_a_run_dir_entry_of_the_wrong_kind_is_exit_2_naming_it(tmp_path: Path, name: str, make: str) -> None:
    entry = tmp_path / name
    if make == "file":
        entry.write_text("not a folder")
    else:
        entry.mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ResumableError, match=name) as caught:
        train(tiny_run(tmp_path, checkpoint_steps=1))
    assert caught.value.exit_code == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name not in ("lock.json", ".lock")) == before


# -- the run dir itself goes away, or turns read-only -------------------------------------------------------
def test_a_run_dir_deleted_under_a_trainer_stops_it_and_is_not_recreated(tmp_path: Path) -> None:
    # Before: the trainer recreated the run dir without its lock (a second trainer could enter) and ended "done".
    run_dir = tmp_path / "run"
    run = tiny_run(run_dir, size=400, checkpoint_steps=4)

    def slow(run, epoch, step) -> None:  # noqa: ANN001
        if step == 6:
            shutil.rmtree(run_dir)  # Colab's file browser, a Drive sync
        time.sleep(0.05)

    train(run, slow)
    assert not run.finished and run.exit_code == 75 and run.outcome.reason == "lock lost"
    assert not run_dir.exists(), "nothing recreated the deleted run dir"


def test_a_checkpoints_folder_that_refuses_writes_is_a_warning_then_exit_75(tmp_path: Path, monkeypatch,
                                                                            capsys) -> None:  # noqa: ANN001
    # Before: PermissionError from creating the step folder ended the run with a traceback (exit 1).
    real = CheckpointManager.begin

    def refused(self, step):  # noqa: ANN001
        if step > 4:
            raise PermissionError(13, "Permission denied", str(self.root))
        return real(self, step)

    monkeypatch.setattr(CheckpointManager, "begin", refused)
    run = train(tiny_run(tmp_path, checkpoint_steps=2, max_steps=8))
    err = capsys.readouterr().err
    assert run.exit_code == 75 and run.outcome.reason == "save error"
    assert "cannot create its folder" in err and "Permission denied" in err and "Traceback" not in err
    assert [i.step for i in CheckpointManager(checkpoints_dir(tmp_path)).inspect() if i.valid] == [2, 4]
