"""Drive's resumable-upload protocol for one file, made to survive a dropped connection and the process itself.

googleapiclient drives the protocol through pydrive2's authenticated service: ``next_chunk()`` sends one chunk
(``Content-Range: bytes a-b/N``), Drive answers 308 with the range it has, and after an error the next call
asks Drive what it holds (``Content-Range: bytes */N``) and goes on from there. So a dropped connection, a 5xx or
a 429 costs at most the chunk in flight, not the bytes already acknowledged.

The session URI is kept in a small record in the local cache (``SessionRecords``), so the next process on the
same VM, after this one was killed mid-upload, asks Drive the same question and continues. The record names what
it uploads (local path, size, mtime, inode; remote folder, name, parent id, the file id when it replaces one):
when the local file or the target changed, or Drive says the session expired (404/410), the upload starts over
from byte 0. Drive checks nothing of this for us, but the caller compares the md5 Drive reports with the local
file's (tiered.Mirror._verify), so a wrong resume can never pass as durable.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .. import log
from ..checkpoint import format as fmt
from ..checkpoint import paths
from .retry import RetryPolicy, StorageError

QUANTUM = 256 * 1024  # Drive's rule: every chunk but the last is a multiple of 256 KiB
# 8 MiB: a cut costs at most one chunk to send again (< 1 s at Colab's usual 10-100 MB/s to Drive), while one
# round trip per 8 MiB keeps the protocol's own cost small (bench_upload_resume.py measures both); googleapiclient's
# 100 MiB default would re-send up to 100 MiB after each cut.
DEFAULT_CHUNK = 8 * 1024 * 1024
SESSION_SUFFIX = ".upload-session.json"
MAX_AGE_S = 6 * 24 * 3600.0  # Drive keeps a session about a week; an older record is dropped unasked
EXPIRED = (404, 410)  # what Drive answers for a session it no longer knows


class SourceUnreadable(Exception):
    """The local file being uploaded could not be read (deleted or damaged under the upload: retention pruned its
    checkpoint, a disk error). Not a storage error: the network is fine, and retrying cannot bring the file back,
    so no retry policy retries it (every client's classify leaves an unknown exception alone); the caller decides
    (tiered.Mirror skips a checkpoint pruned meanwhile)."""

    def __init__(self, path: Path, error: OSError) -> None:
        super().__init__(f"cannot read the local file {path} ({error})")
        self.path = path


class _LocalSource:
    """A file handle for googleapiclient whose read errors are :class:`SourceUnreadable`, never an OSError: a
    client classifies an OSError as a transient network error and would retry a file that is gone."""

    def __init__(self, handle: Any, path: Path) -> None:
        self._handle = handle
        self._path = path

    def _guard(self, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except OSError as e:
            raise SourceUnreadable(self._path, e) from e

    def read(self, size: int = -1) -> bytes:
        return self._guard(lambda: self._handle.read(size))

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._guard(lambda: self._handle.seek(offset, whence))

    def tell(self) -> int:
        return self._guard(self._handle.tell)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def check_chunk_size(size: int) -> int:
    """``size`` if Drive accepts it as a chunk size, else ValueError naming valid ones."""
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size % QUANTUM:
        raise ValueError(f"Drive upload chunk size {size!r} is not a positive multiple of 256 KiB ({QUANTUM} "
                         f"bytes), which Drive requires; use e.g. {DEFAULT_CHUNK} (8 MiB)")
    return size


@dataclass(frozen=True)
class Target:
    """Where the bytes go: a new file ``name`` in the folder ``parent_id``, or the content of ``file_id``."""

    folder: str
    name: str
    parent_id: str
    file_id: str | None


@dataclass(frozen=True)
class SessionRecord:
    uri: str
    path: str
    size: int
    mtime_ns: int
    inode: int
    target: Target
    created_unix: float

    def same_source(self, path: Path, stat: os.stat_result) -> bool:
        return (self.path, self.size, self.mtime_ns, self.inode) == (str(path), stat.st_size, stat.st_mtime_ns,
                                                                       stat.st_ino)

    @classmethod
    def parse(cls, data: Any) -> SessionRecord:
        """A record read back from disk, validated field by field (ValueError: not a record of ours)."""
        if not isinstance(data, dict) or not isinstance(data.get("target"), dict):
            raise ValueError("not an object with a target")
        target = data["target"]
        record = cls(data.get("uri"), data.get("path"), data.get("size"), data.get("mtime_ns"), data.get("inode"),
                     Target(target.get("folder"), target.get("name"), target.get("parent_id"),
                            target.get("file_id")), data.get("created_unix"))
        texts = (record.uri, record.path, record.target.folder, record.target.name, record.target.parent_id)
        numbers = (record.size, record.mtime_ns, record.inode)
        if (not all(isinstance(v, str) for v in texts) or not all(type(v) is int for v in numbers)
                or not isinstance(record.created_unix, (int, float))
                or not (record.target.file_id is None or isinstance(record.target.file_id, str))
                or not record.uri.startswith(("https://", "http://"))):
            raise ValueError("a field is missing or of the wrong type")
        return record


class SessionRecords:
    """One record per remote target, in ``directory`` (None: kept nowhere, every upload starts at byte 0).

    A folder of its own beside ``checkpoints/``, not a file in the step folder: a committed checkpoint stays
    exactly what its manifest lists (nothing for listing, validation, retention or the mirror to skip), and the
    run dir lock that covers the cache covers the records too.
    """

    def __init__(self, directory: Path | None, say: Callable[[str], None] | None = None) -> None:
        self.directory = directory
        self.say = say or log.warning
        self._swept = False

    def _path(self, folder: str, name: str) -> Path:
        assert self.directory is not None
        key = hashlib.sha256(f"{folder}/{name}".encode()).hexdigest()[:24]
        return self.directory / f"{key}{SESSION_SUFFIX}"

    def load(self, folder: str, name: str) -> SessionRecord | None:
        if self.directory is None:
            return None
        self._sweep()
        path = self._path(folder, name)
        try:
            with paths.open_regular(path) as handle:
                record = SessionRecord.parse(json.loads(handle.read(1 << 16)))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # unreadable or not ours: forget it, the upload starts over
            self.say(f"ignoring the upload session record {path} ({e}); uploading {name} from the start")
            self.drop(folder, name)
            return None
        if (record.target.folder, record.target.name) != (folder, name):
            self.drop(folder, name)
            return None
        return record

    def save(self, record: SessionRecord) -> None:
        if self.directory is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fmt.write_json_atomic(self._path(record.target.folder, record.target.name), asdict(record))
        except OSError as e:  # only resuming after a crash is lost; the upload itself goes on
            self.say(f"cannot keep the upload session of {record.target.name} in {self.directory} ({e}); "
                     f"if this process dies, its upload starts over")

    def drop(self, folder: str, name: str) -> None:
        if self.directory is not None:
            paths.unlink_in_dir(self.directory, self._path(folder, name).name)

    def _sweep(self) -> None:
        """Once per process: remove temp files a kill left, records older than Drive keeps a session, and
        records whose local file is gone (its checkpoint was pruned)."""
        if self._swept or self.directory is None or not paths.is_real_dir(self.directory):
            return
        self._swept = True
        for entry in self.directory.iterdir():
            if fmt.TMP_MARK in entry.name:
                paths.unlink_in_dir(self.directory, entry.name)
                continue
            try:
                with paths.open_regular(entry) as handle:
                    record = SessionRecord.parse(json.loads(handle.read(1 << 16)))
                stale = time.time() - record.created_unix > MAX_AGE_S or not os.path.lexists(record.path)
            except (OSError, ValueError) as e:
                self.say(f"ignoring the upload session record {entry} ({e}); its upload starts from the beginning")
                stale = True
            if stale:
                paths.unlink_in_dir(self.directory, entry.name)


class ResumableUpload:
    """Uploads files with Drive's resumable protocol through a pydrive2 ``GoogleDrive``'s auth and service.

    ``classify`` maps client errors to storage errors (gdrive.classify); each chunk is retried by ``policy``, and
    a retry continues from the bytes Drive acknowledged.
    """

    def __init__(self, drive: Any, policy: RetryPolicy, classify: Callable[[BaseException], StorageError | None],
                 records: SessionRecords, chunk_size: int = DEFAULT_CHUNK) -> None:
        self.drive = drive
        self.policy = policy
        self.classify = classify
        self.records = records
        self.chunk_size = check_chunk_size(chunk_size)
        self.resumed_from: int | None = None  # offset the last upload continued from (None: started at 0)

    def upload(self, source: Path, folder: str, name: str, parent_id: str, find_target: Callable[[], Target],
               what: str) -> dict[str, Any]:
        """Upload ``source`` as ``name`` in ``parent_id``; returns Drive's resource of the file.

        find_target: where a new session writes (lists the folder: replace a file of that name, or create one);
        not called when a kept session of this very file is continued."""
        from googleapiclient.http import MediaIoBaseUpload

        self.resumed_from = None
        with paths.open_regular(source) as handle:
            stat = os.fstat(handle.fileno())
            media = MediaIoBaseUpload(_LocalSource(handle, source), "application/octet-stream",
                                      chunksize=self.chunk_size, resumable=True)
            record = self.records.load(folder, name)
            if record is not None and (not record.same_source(source, stat) or record.target.parent_id != parent_id):
                self.records.drop(folder, name)  # the file (or the folder on Drive) changed: start over
                record = None
            for attempt in range(3):  # a session that expires under us is started again, a couple of times
                target = record.target if record is not None else find_target()
                request = self._request(target, media)
                if record is not None and not _same_origin(record.uri, request.uri):
                    # A session URI carries the upload and our token: only ever to the API's own upload host.
                    self.records.say(f"ignoring the upload session record of {name}: its URI is not on "
                                     f"{urlsplit(request.uri).netloc}; uploading from the start")
                    self.records.drop(folder, name)
                    record = None
                    target = find_target()
                    request = self._request(target, media)
                try:
                    if record is not None:
                        done = self._continue(request, record, what)
                        if done is not None:
                            self.records.drop(folder, name)
                            return done
                    return self._send(request, source, stat, target, record, what)
                except StorageError as e:
                    had_session = record is not None or request.resumable_uri is not None
                    if _status(e) not in EXPIRED or not had_session or attempt == 2:
                        raise
                    self.records.drop(folder, name)
                    record = None  # expired (or its target is gone): a new session from byte 0
        raise AssertionError("unreachable")

    def _request(self, target: Target, media: Any) -> Any:
        auth = self.drive.auth
        if auth.service is None:
            auth.Authorize()
        files = auth.service.files()
        if target.file_id is not None:  # replace by id: uploading the name again would create a duplicate
            return files.update(fileId=target.file_id, body={}, media_body=media)
        return files.insert(body={"title": target.name, "parents": [{"id": target.parent_id}],
                                  "mimeType": "application/octet-stream"}, media_body=media)

    def http(self) -> Any:
        """The calling thread's authorized Http, as pydrive2 keeps it (httplib2 is not thread-safe)."""
        local = self.drive.auth.thread_local
        if getattr(local, "http", None) is None:
            local.http = self.drive.auth.Get_Http_Object()
        return local.http

    def _continue(self, request: Any, record: SessionRecord, what: str) -> dict[str, Any] | None:
        """Ask Drive how much of a kept session it holds and point ``request`` there; its resource if complete."""
        from googleapiclient.errors import HttpError

        def ask() -> dict[str, Any] | None:
            headers = {"Content-Range": f"bytes */{record.size}", "Content-Length": "0"}
            resp, content = self.http().request(record.uri, "PUT", headers=headers)
            if resp.status in (200, 201):
                return request.postproc(resp, content)
            if resp.status != 308:
                raise HttpError(resp, content, uri=record.uri)
            moved = resp.get("location", record.uri)
            request.resumable_uri = moved if _same_origin(moved, record.uri) else record.uri
            # "Range: bytes=0-N" is what Drive holds; no Range header: nothing yet.
            held = resp.get("range")
            request.resumable_progress = int(held.rsplit("-", 1)[1]) + 1 if held else 0
            return None

        done = self.policy.call(ask, self.classify, f"asking Drive how much of {what} it holds")
        if done is None:
            self.resumed_from = request.resumable_progress
        return done

    def _send(self, request: Any, source: Path, stat: os.stat_result, target: Target,
              record: SessionRecord | None, what: str) -> dict[str, Any]:
        kept = record.uri if record is not None else None
        http = self.http()
        body = None
        try:
            while body is None:
                # One policy call per chunk: the attempts count since the last progress, and after an error
                # googleapiclient's next call asks Drive (bytes */N) what it holds before sending on.
                _, body = self.policy.call(lambda: request.next_chunk(http=http), self.classify, what)
                if body is None and request.resumable_uri != kept:  # a session worth keeping: more to send
                    kept = request.resumable_uri
                    self.records.save(SessionRecord(kept, str(source), stat.st_size, stat.st_mtime_ns, stat.st_ino,
                                                    target, record.created_unix if record else time.time()))
        except SourceUnreadable:
            # The request stopped part-way through its body: its connection is left mid-request, and the next call
            # on it would time out (and be retried as a network error). Close it; the next call opens a fresh one.
            close = getattr(http, "close", None)
            if close is not None:
                close()
            raise
        finally:
            if body is not None and kept is not None:
                self.records.drop(target.folder, target.name)
        return body


def _same_origin(uri: str, reference: str) -> bool:
    a, b = urlsplit(uri), urlsplit(reference)
    return (a.scheme, a.hostname, a.port) == (b.scheme, b.hostname, b.port)


def _status(error: BaseException) -> int | None:
    """The HTTP status behind a storage error raised by RetryPolicy.call (its cause is the client's error)."""
    cause = error.__cause__
    response = getattr(cause, "resp", None)
    status = getattr(response, "status", None)
    return int(status) if status is not None else None
