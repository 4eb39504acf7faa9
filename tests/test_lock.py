"""One writer per run dir: a live owner refuses a second run, a dead one's lock is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import command, env

from resumable.engine.rundir.lock import LOCK_FILE, RunLock
from resumable.errors import RunDirInUse


def test_second_lock_is_refused_naming_the_owner(tmp_path: Path) -> None:
    with RunLock(tmp_path) as first:
        assert first.acquire() is None
        with pytest.raises(RunDirInUse, match=f"process {os.getpid()} on host {socket.gethostname()}"):
            RunLock(tmp_path).acquire()
    assert not (tmp_path / LOCK_FILE).exists(), "release removes the lock"


def test_lock_of_a_dead_process_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                  "started": "earlier", "heartbeat": time.time()}))
    lock = RunLock(tmp_path)
    message = lock.acquire()
    assert message and f"process {dead.pid}" in message and "gone" in message
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_recycled_pid_and_silent_other_host_are_stale(tmp_path: Path) -> None:
    lock = RunLock(tmp_path, stale_after_s=60)
    recycled = {"pid": os.getpid(), "pid_start": "1", "host": lock.host, "heartbeat": time.time()}
    assert "another process" in lock.stale_reason(recycled)
    remote_fresh = {"pid": 1, "host": "other-host", "heartbeat": time.time()}
    assert lock.stale_reason(remote_fresh) is None
    remote_silent = {"pid": 1, "host": "other-host", "heartbeat": time.time() - 600}
    assert "heartbeat" in lock.stale_reason(remote_silent)
    assert "unreadable" in lock.stale_reason({})


def test_two_trainings_on_one_run_dir(tiny_mnist: Path, tmp_path: Path) -> None:
    args = ["--run-dir", str(tmp_path), "--data-dir", str(tiny_mnist), "--batch-size", "16", "--epochs", "200",
            "--no-progress", "--no-download", "--log-every", "1"]
    first = subprocess.Popen(command() + args, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        second = subprocess.run(command() + args, env=env(), capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert f"process {first.pid}" in second.stderr and "another --run-dir" in second.stderr
    finally:
        first.kill()
        first.wait()
    third = subprocess.run(command() + [*args[:-4], "--max-steps", "3", "--no-download"], env=env(),
                           capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stderr
    assert f"took over the lock of {tmp_path} from process {first.pid}" in third.stderr
