"""The run-dir lock for Drive run dirs: a lease file on the remote, renewed by a heartbeat.

Drive has no atomic create, so the lease is written and read back after a short pause; a second writer
that raced us is seen then. It is read back by its file id: a get by id sees our write at once, while a listing
may not show a new file for seconds to minutes, and a file we cannot list yet must never read as "someone else
holds the run dir". What refuses is another owner's live record that is actually seen: the file we wrote,
overwritten by them, or a newer copy of the lease listed beside ours (of same-titled copies the newest is the
lease, drivelist.py). Two machines training one Drive run dir is the case this guards against
(a notebook re-run on a new VM while the old VM still lives). Anyone who can write to the folder can write
the lease, so it is parsed like the local lock record (engine/rundir/lock.py): an invalid one is unreadable, and an
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

from ..errors import RunDirInUse
from .base import RemoteFile, RemoteStore
from .drivelist import newest_key
from .owner import LockRecord, Owner, in_use_message, lock_record, read_record_file, stale_reason
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
        self._file_id: str | None = None  # the lease file we wrote, when the store reports ids (Drive)

    def _read(self) -> Owner | None:
        """The lease on Drive: None when there is none, :class:`Unreadable` when it is not a valid record."""
        with tempfile.TemporaryDirectory() as scratch:
            target = Path(scratch) / LEASE
            try:
                self.remote.get_file("", LEASE, target)
            except MissingFile:
                return None
            return read_record_file(target)

    def _write(self, record: LockRecord) -> RemoteFile:
        with tempfile.TemporaryDirectory() as scratch:
            source = Path(scratch) / LEASE
            source.write_text(json.dumps(record.to_json()), encoding="utf-8")
            written = self.remote.put_file("", LEASE, source)
        self._file_id = written.file_id
        return written

    def _read_ours(self) -> tuple[Owner | None, RemoteFile | None]:
        """The record in the file we wrote, read by id, and its metadata; (None, None) when it is gone."""
        read_by_id = getattr(self.remote, "read_by_id", None)
        assert read_by_id is not None and self._file_id is not None
        with tempfile.TemporaryDirectory() as scratch:
            target = Path(scratch) / LEASE
            try:
                meta = read_by_id(self._file_id, target)
            except MissingFile:  # deleted by a racing writer whose copy is newer
                return None, None
            return read_record_file(target), meta

    def _by_id(self) -> bool:
        return self._file_id is not None and hasattr(self.remote, "read_by_id") and hasattr(self.remote, "list_files")

    def _contender(self, ours: RemoteFile) -> Owner | None:
        """Another owner's live record listed as a newer copy of the lease than ours; None when there is none (a
        listing that does not show ours yet, or shows nothing at all, is no contender)."""
        listed = self.remote.list_files("").get(LEASE)
        if listed is None or listed.file_id in (None, self._file_id):
            return None
        if newest_key({"modifiedDate": listed.modified, "id": listed.file_id}) <= \
                newest_key({"modifiedDate": ours.modified, "id": ours.file_id}):
            return None
        owner = self._read()
        if isinstance(owner, LockRecord) and not self._ours(owner) and stale_reason(
                owner, self.host, self.stale_after_s) is None:
            return owner
        return None

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
        if self._by_id():
            mine, meta = self._read_ours()
            if not self._ours(mine):  # overwritten by another owner, or deleted because theirs is newer
                raise RunDirInUse(in_use_message(self.remote.description, mine if mine is not None else self._read()))
            assert meta is not None
            contender = self._contender(meta)
            if contender is not None:
                raise RunDirInUse(in_use_message(self.remote.description, contender))
        else:  # a store without file ids (a mounted folder is strongly consistent): read the file back by name
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
                owner = self._challenger()
                if owner is not None:
                    self.lost = (f"the lease of {self.remote.description} was taken over by {owner.host} "
                                 f"(process {owner.pid})")
                    return  # never overwrite the new owner's lease
                self._write(lock_record(self.token, self.host))
            except StorageError:
                pass  # the next beat tries again; a stale lease only lets another machine in later

    def _challenger(self) -> LockRecord | None:
        """Another owner that took the lease over, as far as can be seen; None: it is still ours."""
        if self._by_id():
            mine, meta = self._read_ours()
            if meta is not None and self._ours(mine):
                contender = self._contender(meta)
                return contender if isinstance(contender, LockRecord) else None
            if isinstance(mine, LockRecord):  # our file, overwritten by them
                return mine if mine.token not in ("", self.token) else None
        owner = self._read()  # ours was deleted (theirs is newer), or a store without ids: the listed lease
        return owner if isinstance(owner, LockRecord) and owner.token not in ("", self.token) else None

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            if self._ours(self._read_ours()[0] if self._by_id() else self._read()):
                self._write(replace(lock_record(self.token, self.host), released=True))
        except StorageError:
            pass  # it goes stale by itself
