"""The run-dir lock is a kernel lock: exactly one of N racing starts trains, and a lock or lease record that is
invalid (wrong types, out of range, half-written, not a regular file) is unreadable and taken over, never a
traceback or a hang."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from resumable.engine.rundir.lock import LOCK_FILE, RunLock
from resumable.errors import ResumableError, RunDirInUse
from resumable.storage.base import RemoteFile
from resumable.storage.lease import LEASE, DriveLease
from resumable.storage.owner import MACHINE
from resumable.storage.retry import MissingFile

HOST = socket.gethostname()
RACERS = 20


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _record(**fields) -> bytes:
    return json.dumps({"pid": 4242, "host": HOST, "token": "old", "started": "earlier", "heartbeat": time.time(),
                       **fields}).encode()


def _racer(run_dir: str, go, done, results) -> None:
    """One start: wait for the common go, take the lock, report, and hold it until every racer has reported
    (a start after the winner released would rightly get the lock)."""
    go.wait(60)
    lock = RunLock(Path(run_dir))
    try:
        lock.acquire()
    except RunDirInUse:
        results.put("refused")
        return
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails on it
        results.put(f"error: {e!r}")
        return
    results.put("acquired")
    done.wait(60)
    lock.release()


def _race(run_dir: Path) -> list[str]:
    ctx = multiprocessing.get_context("fork")  # fork: the racers start in milliseconds, all already imported
    go, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
    racers = [ctx.Process(target=_racer, args=(str(run_dir), go, done, results)) for _ in range(RACERS)]
    for racer in racers:
        racer.start()
    time.sleep(0.3)  # all of them waiting at the gate
    go.set()
    try:
        outcomes = [results.get(timeout=60) for _ in racers]
    finally:
        done.set()
        for racer in racers:
            racer.join(30)
    return outcomes


def _write_stale_other_host(lock_file: Path) -> None:
    lock_file.write_bytes(_record(host="another-host", heartbeat=time.time() - 3600))


@pytest.mark.parametrize("prepare", [
    lambda f: f.write_bytes(b""),
    lambda f: f.write_bytes(b'{"pid": 12'),
    lambda f: f.write_bytes(_record(pid=_dead_pid())),
    _write_stale_other_host,
], ids=["empty-lock-file", "half-written-lock-file", "dead-pid", "stale-other-host"])
def test_exactly_one_of_twenty_racing_starts_takes_the_lock(tmp_path: Path, prepare) -> None:
    for round_ in range(3):
        run_dir = tmp_path / f"round-{round_}"
        run_dir.mkdir()
        prepare(run_dir / LOCK_FILE)
        outcomes = _race(run_dir)
        assert sorted(outcomes) == ["acquired"] + ["refused"] * (RACERS - 1), outcomes
        assert not (run_dir / LOCK_FILE).exists(), "the winner released its lock"


def _other(**fields) -> bytes:
    return _record(host="another-host", **fields)


INVALID_RECORDS = {
    "empty": b"",
    "whitespace": b"  \n",
    "half-written": b'{"pid": 12, "host": "x',
    "a-list": b"[1, 2]",
    "null": b"null",
    "a-string": b'"locked"',
    "pid-text": _record(pid="abc"),
    "pid-2**70": _record(pid=2**70),
    "pid-negative": _record(pid=-5),
    "pid-zero": _record(pid=0),
    "pid-bool": _record(pid=True),
    "pid-float": _record(pid=1.5),
    "pid-missing": json.dumps({"host": HOST, "heartbeat": time.time()}).encode(),
    "host-number": _record(host=123),
    "host-empty": _record(host=""),
    "heartbeat-text": _other(heartbeat="soon"),
    "heartbeat-null": _other(heartbeat=None),
    "heartbeat-NaN": b'{"pid": 7, "host": "another-host", "heartbeat": NaN}',
    "heartbeat-Infinity": b'{"pid": 7, "host": "another-host", "heartbeat": Infinity}',
    "released-text": _record(released="yes"),
    "token-number": _record(token=12345),
    "not-utf8": b'\xff\xfe{"pid": 1}',
    "deep-nesting": b"[" * 100_000,
    "huge-int": b'{"pid": ' + b"7" * 5000 + b', "host": "h", "heartbeat": 1}',
    "oversized": b" " * (1 << 20) + _record(),
}


def _acquire_within(lock: RunLock, seconds: float = 20) -> tuple[str | None, BaseException | None]:
    """acquire() in a thread, so a hang (a FIFO opened for reading) fails the test instead of stalling it."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["message"] = lock.acquire()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        fifo = lock.path
        if fifo.exists():  # unblock a reader stuck on a FIFO
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"acquire() did not return within {seconds}s")
    return box.get("message"), box.get("error")  # type: ignore[return-value]


def _assert_taken_over_cleanly(run_dir: Path, message: str | None, error: BaseException | None,
                               fragment: str = "unreadable") -> None:
    assert error is None, f"{type(error).__name__}: {error}"
    assert message and "took over the lock" in message and fragment in message, message
    record = json.loads((run_dir / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["host"] == HOST


@pytest.mark.parametrize("content", INVALID_RECORDS.values(), ids=INVALID_RECORDS.keys())
def test_an_invalid_lock_record_is_taken_over_cleanly(tmp_path: Path, content: bytes) -> None:
    (tmp_path / LOCK_FILE).write_bytes(content)
    lock = RunLock(tmp_path)
    message, error = _acquire_within(lock)
    try:
        _assert_taken_over_cleanly(tmp_path, message, error)
    finally:
        lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_heartbeat_far_in_the_future_does_not_hold_the_run_dir_for_ever(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_bytes(_other(heartbeat=1e300))
    lock = RunLock(tmp_path)
    message, error = _acquire_within(lock)
    try:
        _assert_taken_over_cleanly(tmp_path, message, error, fragment="in the future")
    finally:
        lock.release()


def test_a_fifo_lock_record_is_not_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / LOCK_FILE)
    lock = RunLock(tmp_path)
    message, error = _acquire_within(lock, seconds=10)
    try:
        _assert_taken_over_cleanly(tmp_path, message, error, fragment="not a regular file")
    finally:
        lock.release()


def test_a_symlinked_lock_record_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.json"
    original = _other()
    outside.write_bytes(original)  # a live owner's record, were the link followed
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).symlink_to(outside)
    lock = RunLock(run_dir)
    message, error = _acquire_within(lock)
    try:
        _assert_taken_over_cleanly(run_dir, message, error, fragment="not a regular file")
        assert not (run_dir / LOCK_FILE).is_symlink()
    finally:
        lock.release()
    assert outside.read_bytes() == original, "the file the link pointed to is untouched"


@pytest.mark.parametrize("name", [LOCK_FILE, ".lock"])
def test_a_folder_where_a_lock_file_belongs_is_a_clear_error(tmp_path: Path, name: str) -> None:
    (tmp_path / name).mkdir()
    with pytest.raises(ResumableError, match=name.replace(".", r"\.")) as err:
        RunLock(tmp_path).acquire()
    assert "remove it" in str(err.value) or "fix it" in str(err.value)
    assert (tmp_path / name).is_dir()


def test_on_this_host_only_the_kernel_lock_holds(tmp_path: Path) -> None:
    """A record naming a live process that does not hold the kernel lock (a notebook kernel whose release
    failed, a pid file copied along) does not block; a holder blocks whatever the record says."""
    (tmp_path / LOCK_FILE).write_bytes(_record(pid=os.getppid()))
    lock = RunLock(tmp_path)
    message = lock.acquire()
    try:
        assert message and f"process {os.getppid()} on this host does not hold the lock" in message
        (tmp_path / LOCK_FILE).write_bytes(b"")  # a damaged record does not let a second start in either
        with pytest.raises(RunDirInUse, match="another process"):
            RunLock(tmp_path).acquire()
    finally:
        lock.release()


def test_another_hosts_fresh_record_still_holds_and_a_silent_one_is_taken_over(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_bytes(_other())
    with pytest.raises(RunDirInUse, match="process 4242 on host another-host"):
        RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["host"] == "another-host", "its record stays"
    (tmp_path / LOCK_FILE).write_bytes(_other(heartbeat=time.time() - 600))
    lock = RunLock(tmp_path, stale_after_s=180)
    try:
        message = lock.acquire()
        assert message and "another-host" in message and "heartbeat is 600s old" in message
    finally:
        lock.release()


def test_the_heartbeat_refreshes_the_record_repairs_it_and_notices_a_new_owner(tmp_path: Path) -> None:
    lock = RunLock(tmp_path, heartbeat_s=0.05)
    lock.acquire()
    try:
        first = json.loads((tmp_path / LOCK_FILE).read_text())
        time.sleep(0.4)
        later = json.loads((tmp_path / LOCK_FILE).read_text())
        assert later["token"] == first["token"] and later["heartbeat"] > first["heartbeat"]
        with pytest.raises(RunDirInUse, match=f"process {os.getpid()}"):
            RunLock(tmp_path).acquire()  # refreshing the record (a new inode each time) keeps the lock
        (tmp_path / LOCK_FILE).unlink()  # removed by someone: we hold the kernel lock, so it is repaired
        time.sleep(0.4)
        assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == lock.token and lock.lost is None
        (tmp_path / LOCK_FILE).write_bytes(_other(token="theirs"))
        deadline = time.monotonic() + 5
        while lock.lost is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lock.lost and "process 4242 on another-host" in lock.lost
    finally:
        lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "theirs", "the new owner's record stays"


def test_a_forked_child_does_not_keep_a_killed_trainers_lock(tmp_path: Path) -> None:
    """A DataLoader worker forked by the trainer shares its lock file; the kernel lock must still end with the
    trainer, not with the last worker."""
    script = (f"import os, time\nfrom pathlib import Path\nfrom resumable.engine.rundir.lock import RunLock\n"
              f"RunLock(Path({str(tmp_path)!r})).acquire()\n"
              f"child = os.fork()\n"
              f"if child == 0:\n    os.close(1)\n    os.close(2)\n    time.sleep(60)\n    os._exit(0)\n"
              f"print(child, flush=True)\nos.kill(os.getpid(), 9)\n")
    trainer = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    child = int(trainer.stdout.split()[0])
    try:
        lock = RunLock(tmp_path)
        message = lock.acquire()
        assert message and "gone" in message, message
        lock.release()
    finally:
        os.kill(child, 9)


def test_a_start_that_wrote_nothing_leaves_no_folder(tmp_path: Path) -> None:
    lock = RunLock(tmp_path / "new" / "run")
    lock.acquire()
    lock.release()
    assert list(tmp_path.iterdir()) == []
    kept = tmp_path / "kept"
    lock = RunLock(kept)
    lock.acquire()
    (kept / "metrics.jsonl").write_text("{}\n")
    lock.release()
    assert sorted(p.name for p in kept.iterdir()) == ["metrics.jsonl"], "a run dir with content stays, clean"


class MemoryStore:
    """A RemoteStore holding the lease in memory (the Drive side of the lease, nothing else)."""

    description = "gdrive://root/lease-test"

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def get_file(self, folder: str, name: str, target: Path) -> None:
        if name not in self.files:
            raise MissingFile(name)
        Path(target).write_bytes(self.files[name])

    def put_file(self, folder: str, name: str, source: Path) -> RemoteFile:
        self.files[name] = Path(source).read_bytes()
        return RemoteFile(len(self.files[name]))


INVALID_LEASES = {k: INVALID_RECORDS[k] for k in (
    "empty", "a-list", "pid-text", "pid-2**70", "heartbeat-text", "heartbeat-null", "heartbeat-Infinity",
    "not-utf8", "deep-nesting")}


@pytest.mark.parametrize("content", INVALID_LEASES.values(), ids=INVALID_LEASES.keys())
def test_an_invalid_drive_lease_is_taken_over_cleanly(content: bytes) -> None:
    store = MemoryStore()
    store.files[LEASE] = content
    lease = DriveLease(store, settle_s=0)
    try:
        message = lease.acquire()
        assert message and "took over the lease" in message and "unreadable" in message, message
        assert json.loads(store.files[LEASE])["token"] == lease.token
    finally:
        lease.release()
    assert json.loads(store.files[LEASE])["released"] is True


def _record_of(pid: int, machine: str) -> bytes:
    """A fresh lease record of this hostname (a container or cloned VM image shares it) on ``machine``."""
    return json.dumps({"pid": pid, "host": socket.gethostname(), "heartbeat": time.time(), "token": "theirs",
                       "started": "", "machine": machine}).encode()


def test_a_live_lease_of_another_machine_with_this_hostname_holds() -> None:
    # Before: "same host" meant the same hostname, so its pid was judged here, found gone, and the live lease of a
    # cloned VM or a container was taken over.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is not alive here
    store = MemoryStore()
    store.files[LEASE] = _record_of(gone.pid, machine="0123456789abcdef")
    with pytest.raises(RunDirInUse, match="being trained by process"):
        DriveLease(store, settle_s=0).acquire()
    store.files[LEASE] = _record_of(gone.pid, machine=MACHINE)  # on this machine, its pid is judged: gone
    lease = DriveLease(store, settle_s=0)
    try:
        assert f"process {gone.pid} on this host is gone" in lease.acquire()
    finally:
        lease.release()
