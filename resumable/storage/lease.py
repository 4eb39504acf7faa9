"""The run-dir lock for Drive run dirs: a lease file on the remote, renewed by a heartbeat.

Drive has no atomic create, so the lease is written and read back after a short pause; a second writer
that raced us is seen then. Two machines training one Drive run dir is the case this guards against
(a notebook re-run on a new VM while the old VM still lives).
"""

from __future__ import annotations

import json
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ..engine.lock import in_use_message, lock_record, stale_reason
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

    def _read(self) -> dict[str, Any] | None:
        with tempfile.TemporaryDirectory() as scratch:
            target = Path(scratch) / LEASE
            try:
                self.remote.get_file("", LEASE, target)
            except MissingFile:
                return None
            try:
                data = json.loads(target.read_text(encoding="utf-8"))
            except ValueError:
                return {}
        return data if isinstance(data, dict) else {}

    def _write(self, record: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            source = Path(scratch) / LEASE
            source.write_text(json.dumps(record), encoding="utf-8")
            self.remote.put_file("", LEASE, source)

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
        now = self._read() or {}
        if now.get("token") != self.token:
            raise RunDirInUse(in_use_message(self.remote.description, now))
        self._thread = threading.Thread(target=self._beat, name="resumable-lease", daemon=True)
        self._thread.start()
        if owner is not None and not owner.get("released"):
            return f"took over the lease of {self.remote.description} from {owner.get('host')}: {reason}"
        return None

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                owner = self._read()
                if owner is not None and owner.get("token") not in (None, self.token):
                    self.lost = (f"the lease of {self.remote.description} was taken over by {owner.get('host')} "
                                 f"(process {owner.get('pid')})")
                    return  # never overwrite the new owner's lease
                self._write(lock_record(self.token, self.host))
            except StorageError:
                pass  # the next beat tries again; a stale lease only lets another machine in later

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if (self._read() or {}).get("token") == self.token:
                self._write({**lock_record(self.token, self.host), "released": True})
        except StorageError:
            pass  # it goes stale by itself
