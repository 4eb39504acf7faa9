"""The run-dir lock for Drive run dirs: a lease file on the remote, renewed by a heartbeat.

Drive has no atomic create, so the lease is written and read back after a short pause; a second writer
that raced us is seen then. Two machines training one Drive run dir is the case this guards against
(a notebook re-run on a new VM while the old VM still lives). Anyone who can write to the folder can write
the lease, so it is parsed like the local lock record (engine/lock.py): an invalid one is unreadable, and an
unreadable lease is taken over like a stale one.
"""

from __future__ import annotations

import json
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

from ..engine.lock import LockRecord, Owner, in_use_message, lock_record, read_record_file, stale_reason
from ..errors import RunDirInUse
from .base import RemoteStore
from .retry import MissingFile, StorageError

LEASE = "lease.json"


class DriveLease:
    def __init__(self, remote: RemoteStore, heartbeat_s: float = 60.0, stale_after_s: float = 300.0,
                 settle_s: float = 1.0) -> None:
        self.remote = remote
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.settle_s = settle_s
        self.token = uuid.uuid4().hex
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None  # set when another machine took the lease over

    def _read(self) -> Owner | None:
        """The lease on Drive: None when there is none, :class:`Unreadable` when it is not a valid record."""
        with tempfile.TemporaryDirectory() as scratch:
            target = Path(scratch) / LEASE
            try:
                self.remote.get_file("", LEASE, target)
            except MissingFile:
                return None
            return read_record_file(target)

    def _write(self, record: LockRecord) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            source = Path(scratch) / LEASE
            source.write_text(json.dumps(record.to_json()), encoding="utf-8")
            self.remote.put_file("", LEASE, source)

    def _ours(self, owner: Owner | None) -> bool:
        return isinstance(owner, LockRecord) and owner.token == self.token

    def acquire(self) -> str | None:
        """Take the lease; returns a message if a stale one was taken over. Raises RunDirInUse."""
        owner = self._read()
        reason = None
        if owner is not None:
            reason = stale_reason(owner, self.host, self.stale_after_s)
            if reason is None:
                raise RunDirInUse(in_use_message(self.remote.description, owner))
        self._write(lock_record(self.token, self.host))
        time.sleep(self.settle_s)
        now = self._read()
        if not self._ours(now):
            raise RunDirInUse(in_use_message(self.remote.description, now))
        self._thread = threading.Thread(target=self._beat, name="resumable-lease", daemon=True)
        self._thread.start()
        if isinstance(owner, LockRecord) and owner.released:
            return None
        if owner is not None:
            who = owner.host if isinstance(owner, LockRecord) else "an unknown owner"
            return f"took over the lease of {self.remote.description} from {who}: {reason}"
        return None

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                owner = self._read()
                if isinstance(owner, LockRecord) and owner.token not in ("", self.token):
                    self.lost = (f"the lease of {self.remote.description} was taken over by {owner.host} "
                                 f"(process {owner.pid})")
                    return  # never overwrite the new owner's lease
                self._write(lock_record(self.token, self.host))
            except StorageError:
                pass  # the next beat tries again; a stale lease only lets another machine in later

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self._ours(self._read()):
                self._write(replace(lock_record(self.token, self.host), released=True))
        except StorageError:
            pass  # it goes stale by itself
