"""One writer per run dir: a kernel lock held for the whole run, and a record that names its owner.

Two notebooks training into one run dir would interleave checkpoints and metrics. On this host the truth is
``flock(LOCK_EX | LOCK_NB)`` on ``RUN_DIR/.lock``: exactly one of any number of racing starts gets it, and the
kernel drops it when its process ends however it ends, so a dead owner never blocks and no pid is judged.
``RUN_DIR/lock.json`` beside it records pid, host, machine, start time and a heartbeat (a background thread). It is a
separate file because it is replaced atomically (temp file + ``os.replace``: never seen half-written), which
gives it a new inode each time, while a flock belongs to one inode. The record serves the messages and the one
case the kernel lock cannot see: a shared file system that does not carry flock between hosts, where another
host's record holds until its heartbeat is older than ``stale_after_s``. "Another host" is judged by
:func:`machine_id` (machine id, boot id, pid namespace), not by the hostname alone: containers and cloned VM images
share hostnames, and a pid is only meaningful where it was handed out.

Every record is parsed into a :class:`~resumable.storage.owner.LockRecord` (storage/owner.py: types and ranges
checked); an unreadable one leaves the decision to the kernel lock alone. The Drive lease (storage/lease.py) uses
the same record and staleness rules, without a kernel lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import threading
import time
import uuid
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

from ... import log
from ...atomic import replace_with
from ...errors import ResumableError, RunDirInUse
from ...storage.owner import (
    LockRecord,
    Owner,
    Unreadable,
    in_use_message,
    lock_record,
    parse_record,
    read_record_file,
    same_machine,
    stale_reason,
)

LOCK_FILE = "lock.json"
KERNEL_LOCK_FILE = ".lock"
_NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)  # CLOEXEC: a spawned tool must not inherit the lock
_HELD: weakref.WeakSet[RunLock] = weakref.WeakSet()


def _drop_in_child() -> None:
    """A forked child (a DataLoader worker) shares the parent's open lock file, and a flock lasts until every
    copy is closed: a worker outliving a killed trainer would hold its run dir. The child closes its copy (the
    parent's lock is unaffected) and owns nothing."""
    for lock in list(_HELD):
        if lock._fd is not None:
            try:
                os.close(lock._fd)
            except OSError:
                pass
        lock._fd, lock._thread, lock._created = None, None, []
        lock._stop.set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)


class RunLock:
    """The lock of one local run dir, held from :meth:`acquire` to :meth:`release`::

        lock = RunLock(Path("runs/demo"))
        message = lock.acquire()  # None, or whose stale lock was taken over; raises RunDirInUse
        ...
        lock.release()
    """

    def __init__(self, run_dir: Path, heartbeat_s: float = 30.0, stale_after_s: float = 180.0) -> None:
        self.dir = Path(run_dir)
        self.path = self.dir / LOCK_FILE
        self.kernel_path = self.dir / KERNEL_LOCK_FILE
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.token = uuid.uuid4().hex
        self.host = socket.gethostname()
        self._fd: int | None = None  # the open file the kernel lock is on
        self._created: list[Path] = []  # folders this lock created, deepest first: removed at release if empty
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None  # set when another process took the lock over: stop, write nothing more
        self._gone_checked = 0.0

    def _read(self) -> Owner | None:
        return read_record_file(self.path)

    def stale_reason(self, owner: Owner | dict[str, Any]) -> str | None:
        """Why ``owner`` (a record, parsed or raw) no longer holds the lock, judged from the record alone."""
        return stale_reason(parse_record(owner) if isinstance(owner, dict) else owner, self.host,
                            self.stale_after_s)

    def acquire(self) -> str | None:
        """Take the lock; returns a message if a stale lock was taken over. Raises RunDirInUse."""
        self._make_dir()
        for _ in range(20):
            fd = self._open_kernel_lock()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                self._remove_created()
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise RunDirInUse(self._held_message()) from None
                raise ResumableError(f"cannot lock {self.kernel_path}: {e.strerror or e}. This file system does not "
                                     f"support file locks; use a run dir on a local disk (or gdrive://)") from e
            if not self._still_linked(fd):  # its owner released (and removed) it between our open and flock
                os.close(fd)
                continue
            self._fd = fd
            _HELD.add(self)
            try:
                return self._claim()
            except BaseException:
                self._give_up(remove=True)
                raise
        raise RunDirInUse(f"could not take the lock {self.kernel_path}: other processes keep taking and releasing "
                          f"it; run again")

    def _held_message(self) -> str:
        owner = self._read()
        if isinstance(owner, LockRecord) and self.stale_reason(owner) is None:
            return in_use_message(str(self.dir), owner)
        # The holder has not written its record yet: it is taking the lock over right now, or it is a process
        # left behind by a killed run that still has the lock file open.
        return (f"{self.dir} is locked by another process whose lock record is not written yet (a start in progress, "
                f"or a process left behind by a killed run: `fuser {self.kernel_path}` names it); wait a moment and "
                f"run again, or use another --run-dir")

    def _make_dir(self) -> None:
        missing, folder = [], self.dir.absolute()
        while not os.path.lexists(folder) and folder.parent != folder:
            missing.append(folder)
            folder = folder.parent
        self._created = missing
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._remove_created()
            raise ResumableError(f"cannot create the run dir {self.dir}: {e.strerror or e}; choose a run dir "
                                 f"that can be created here") from e

    def _open_kernel_lock(self) -> int:
        try:
            fd = os.open(self.kernel_path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW, 0o644)
        except OSError as e:
            self._remove_created()
            raise ResumableError(f"cannot open the lock file {self.kernel_path}: {e.strerror or e}. It must be a "
                                 f"regular file this user can write (not a symlink or folder): remove it, or use "
                                 f"another --run-dir") from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ResumableError(f"the lock file {self.kernel_path} is not a regular file; remove it, or use another "
                                 f"--run-dir")
        return fd

    def _still_linked(self, fd: int) -> bool:
        try:
            here = os.stat(self.kernel_path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)

    def _claim(self) -> str | None:
        """With the kernel lock held: judge the record left there, write ours, start the heartbeat."""
        owner = self._read()
        reason = None
        if isinstance(owner, Unreadable):
            reason = f"its record is unreadable ({owner.reason})"
        elif isinstance(owner, LockRecord) and not owner.released:
            reason = self.stale_reason(owner)
            if same_machine(owner, self.host):  # a live owner here would hold the kernel lock we now hold
                reason = reason or f"process {owner.pid} on this host does not hold the lock any more"
            elif reason is None:  # another host, on a file system that may not carry flock across hosts
                raise RunDirInUse(f"{in_use_message(str(self.dir), owner)}. (Its heartbeat is "
                                  f"{max(0.0, time.time() - owner.heartbeat):.0f}s old; a lock of another host is "
                                  f"taken over after {self.stale_after_s:.0f}s without one.)")
        try:
            self._write(lock_record(self.token, self.host))
        except OSError as e:
            raise ResumableError(f"cannot write the lock record {self.path}: {e.strerror or e}. It must be a "
                                 f"regular file (or absent) in a writable folder: fix it, or use another "
                                 f"--run-dir") from e
        self._thread = threading.Thread(target=self._beat, name="resumable-lock", daemon=True)
        self._thread.start()
        if reason is None:
            return None
        who = f"process {owner.pid} on {owner.host}" if isinstance(owner, LockRecord) else "an unknown owner"
        return f"took over the lock of {self.dir} from {who}: {reason}"

    def _write(self, record: LockRecord) -> None:
        """Replace the record atomically: a reader sees the old one or the new one, never half of one."""
        replace_with(self.path, json.dumps(record.to_json()).encode("utf-8"), durable=False, tag=self.token)

    def _beat(self) -> None:
        failing = False
        while not self._stop.wait(self.heartbeat_s):
            owner = self._read()
            if not isinstance(owner, LockRecord):  # a writer that is not atomic may be half-way: look again
                time.sleep(min(0.05, self.heartbeat_s))
                owner = self._read()
            if isinstance(owner, LockRecord) and owner.token != self.token:  # never write another owner's lock
                self.lost = (f"the lock of {self.dir} was taken over by process {owner.pid} on {owner.host}")
                return
            # Ours, or gone or damaged while we hold the kernel lock: on this host we still own it, so repair it.
            record = owner if isinstance(owner, LockRecord) else lock_record(self.token, self.host)
            try:
                self._write(replace(record, heartbeat=time.time()))
                failing = False
            except OSError as e:  # a full or read-only disk: training goes on, the next beat tries again
                if not failing:
                    log.warning(f"cannot refresh the lock record {self.path} ({e.strerror or e}); retrying at the "
                                f"next heartbeat")
                failing = True

    def gone(self, every_s: float = 1.0) -> str | None:
        """Why the run dir is not ours any more although nobody took the lock: its lock file (or the whole run dir)
        was deleted or replaced under us (Colab's file browser, a Drive sync). Checked at most every ``every_s``
        seconds (one stat), so that a loop may ask at every step."""
        now = time.monotonic()
        if self.lost is not None or self._fd is None or now - self._gone_checked < every_s:
            return self.lost
        self._gone_checked = now
        if not self._still_linked(self._fd):
            self.lost = (f"{self.dir} was deleted or replaced while training (its lock file {self.kernel_path.name} is "
                         f"gone): stopped without writing more, and nothing is recreated there. Put the run dir "
                         f"back (its committed checkpoints) or use another --run-dir, then run again")
        return self.lost

    def release(self) -> None:
        """Give the lock up (never raises): remove our record, then the lock file, then close it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._fd is None:
            return
        try:
            owner = self._read()
            if isinstance(owner, LockRecord) and owner.token == self.token:
                self.path.unlink(missing_ok=True)
        except OSError as e:
            log.warning(f"cannot remove the lock record {self.path} ({e.strerror or e}); the next start takes it "
                        f"over")
        # Removing the lock file is safe only while we hold it: a process that opened it just before finds it
        # unlinked after its flock (_still_linked) and tries again. A lost lock is the new owner's: left alone.
        self._give_up(remove=self.lost is None)

    def _give_up(self, remove: bool) -> None:
        if remove:
            try:
                self.kernel_path.unlink(missing_ok=True)
            except OSError:
                pass  # a read-only disk: the file stays, unlocked, and the next start reuses it
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        _HELD.discard(self)
        self._remove_created()

    def _remove_created(self) -> None:
        """A start that wrote nothing leaves no folder behind (only empty ones this lock created go)."""
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:
                break  # not empty (the run wrote into it), or gone
        self._created = []

    def __enter__(self) -> RunLock:  # releases at exit; acquire() is explicit
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
