"""A loopback HTTP fake of the Google Drive v2 API subset pydrive2 uses, with fault injection.

The fake is a real ``ThreadingHTTPServer`` on 127.0.0.1, so the real pydrive2 -> googleapiclient -> httplib2 ->
socket stack runs unmodified; only the host is rewritten (``RewritingHttp``). That way tests see the genuine
error types, retries and timeouts those libraries produce, not a mock's idea of them.

Typical use::

    with FakeDrive() as fake:
        drive = make_drive(fake)
        fake.inject("503", match="upload_id=")    # fail the first resumable-upload chunk
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import secrets
import socket
import struct
import sys
import threading
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import httplib2
from googleapiclient.discovery import build
from oauth2client.client import AccessTokenCredentials
from pydrive2.auth import GoogleAuth
from pydrive2.drive import GoogleDrive

FOLDER_MIME = "application/vnd.google-apps.folder"
DEFAULT_TOKEN = "fake-token"
USER_AGENT = "resumable-tests"

# Status faults: name -> (HTTP status, error reason, message). Bodies mimic real Drive v2 JSON errors.
STATUS_FAULTS: dict[str, tuple[int, str, str]] = {
    "userRateLimitExceeded": (403, "userRateLimitExceeded", "User Rate Limit Exceeded"),
    "rateLimitExceeded": (403, "rateLimitExceeded", "Rate Limit Exceeded"),
    "storageQuotaExceeded": (403, "storageQuotaExceeded", "The user's Drive storage quota has been exceeded."),
    "429": (429, "rateLimitExceeded", "Too Many Requests"),
    "500": (500, "backendError", "Backend Error"),
    "503": (503, "backendError", "Service Unavailable"),
}
# Gateway errors from Google's front end come back as HTML, not JSON.
HTML_FAULTS: dict[str, int] = {"html502": 502, "html503": 503}
# drop: read half the body, then reset the connection (RST) -- what a dying proxy or NAT does.
# close: read the whole body, then close cleanly (FIN) without answering -- a stale keep-alive.
# stall: apply the request, then wait before answering, so a client with a shorter timeout gives up.
CONNECTION_FAULTS = ("drop", "close", "stall")
FAULTS = (*STATUS_FAULTS, *HTML_FAULTS, *CONNECTION_FAULTS)

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_REASON_PHRASES = {308: "Resume Incomplete"}  # Google's name for 308 in resumable uploads


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _new_id() -> str:
    # Real Drive ids are ~33 url-safe characters; tests must not depend on their shape.
    return "1" + secrets.token_urlsafe(24)[:32]


def error_body(status: int, reason: str, message: str, domain: str = "global") -> bytes:
    """A Drive v2 JSON error document, the shape googleapiclient and pydrive2 parse."""
    error = {"errors": [{"domain": domain, "reason": reason, "message": message}], "code": status, "message": message}
    return json.dumps({"error": error}).encode()


@dataclass
class StoredFile:
    id: str
    title: str
    mime_type: str
    parents: list[str]
    content: bytes = b""
    trashed: bool = False
    explicitly_trashed: bool = False
    created: str = field(default_factory=_now)
    modified: str = field(default_factory=_now)
    version: int = 1
    extra: dict[str, Any] = field(default_factory=dict)  # writable fields we only echo (description, ...)

    @property
    def is_folder(self) -> bool:
        return self.mime_type == FOLDER_MIME

    @property
    def md5(self) -> str:
        return hashlib.md5(self.content).hexdigest()


@dataclass
class Fault:
    kind: str
    remaining: int
    match: str | None = None
    skip: int = 0
    seconds: float = 0.0

    def matches(self, target: str) -> bool:
        return self.match is None or self.match in target


@dataclass
class _UploadSession:
    file_id: str | None  # None: create a new file on completion; else replace that file's content
    metadata: dict[str, Any]
    mime_type: str
    total: int | None
    data: bytearray = field(default_factory=bytearray)
    done_id: str | None = None  # set once complete, so a status query after a lost reply still gets 200


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def _json_reply(obj: Any, status: int = 200) -> Reply:
    return Reply(status, json.dumps(obj).encode(), {"Content-Type": "application/json; charset=UTF-8"})


def _error(status: int, reason: str, message: str) -> Reply:
    return Reply(status, error_body(status, reason, message), {"Content-Type": "application/json; charset=UTF-8"})


class DriveError(Exception):
    """Raised inside request handling to produce a Drive-style JSON error reply."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.reply = _error(status, reason, message)


# --- files.list q parsing -------------------------------------------------------------------------------------------
_STR = r"'((?:[^'\\]|\\.)*)'"
_CLAUSES = [
    ("parent", re.compile(_STR + r"\s+in\s+parents", re.I)),
    ("trashed", re.compile(r"trashed\s*(=|!=)\s*(true|false)", re.I)),
    ("field", re.compile(r"(title|mimeType)\s*(=|!=|contains)\s*" + _STR)),
]
_AND = re.compile(r"\s+and\s+", re.I)


def parse_query(q: str) -> list[tuple[str, ...]]:
    """Split a Drive v2 ``q`` into clauses; unsupported syntax is a 400, so tests never silently match everything."""
    clauses: list[tuple[str, ...]] = []
    pos, q = 0, q.strip()
    while pos < len(q):
        for kind, pattern in _CLAUSES:
            m = pattern.match(q, pos)
            if m:
                groups = tuple(re.sub(r"\\(.)", r"\1", g) if g is not None else "" for g in m.groups())
                clauses.append((kind, *groups))
                pos = m.end()
                break
        else:
            raise DriveError(400, "invalid", f"Invalid query (fake supports a subset): {q[pos:]!r}")
        sep = _AND.match(q, pos)
        if sep:
            pos = sep.end()
        elif pos < len(q):
            raise DriveError(400, "invalid", f"Invalid query near: {q[pos:]!r}")
    return clauses


# --- the fake ------------------------------------------------------------------------------------------------------
class FakeDrive:
    """In-memory Drive v2 served over loopback HTTP.

    upload_chunk_limit: commit at most this many bytes per resumable PUT and answer 308, as real Drive may; this
        forces multi-request uploads even though pydrive2 always sends 100 MiB chunks.
    quota_bytes: total storage; uploads that would exceed it fail with 403 storageQuotaExceeded.
    token: bearer token every API call must carry (None disables the check).
    """

    def __init__(
        self,
        *,
        token: str | None = DEFAULT_TOKEN,
        upload_chunk_limit: int | None = None,
        quota_bytes: int | None = None,
        stall_seconds: float = 3.0,
    ) -> None:
        self.token = token
        self.upload_chunk_limit = upload_chunk_limit
        self.quota_bytes = quota_bytes
        self.stall_seconds = stall_seconds
        self.lock = threading.RLock()
        self.root_id = "0A" + secrets.token_urlsafe(12)  # real root ids are opaque; 'root' is only an alias
        self.files: dict[str, StoredFile] = {self.root_id: StoredFile(self.root_id, "My Drive", FOLDER_MIME, [])}
        self.requests: list[tuple[str, str]] = []  # (method, path?query), in arrival order
        self.responses: list[tuple[str, str, int]] = []  # (method, path?query, status) of each reply written
        self.faults_fired: list[tuple[str, str, str]] = []  # (fault, method, path?query)
        self.upload_ranges: list[str] = []  # Content-Range of every resumable-session PUT, e.g. "bytes */4096"
        self.server_errors: list[str] = []  # tracebacks of bugs in the fake itself; tests assert it stays empty
        self._faults: list[Fault] = []
        self._sessions: dict[str, _UploadSession] = {}
        self._connections: set[socket.socket] = set()  # open client connections, cut on stop()
        self._stop = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # lifecycle
    def start(self) -> FakeDrive:
        server = _Server(("127.0.0.1", 0), _Handler)
        server.drive = self
        self._server = server
        # A short poll interval keeps stop() (which waits for the serve loop to notice) fast.
        self._thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="fake-drive", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()  # wake stalled handlers
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self.lock:
            connections, self._connections = list(self._connections), set()
        for conn in connections:  # otherwise keep-alive handler threads would keep serving a "stopped" fake
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> FakeDrive:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "FakeDrive not started"
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # fault injection
    def inject(
        self, fault: str | int, count: int = 1, match: str | None = None, *, skip: int = 0, seconds: float | None = None
    ) -> Fault:
        """Make the next ``count`` requests whose "METHOD /path?query" contains ``match`` fail with ``fault``.

        skip: let that many matching requests through first (e.g. fail the 3rd upload chunk).
        seconds: stall duration (default ``stall_seconds``).
        """
        kind = str(fault)
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; choose from {FAULTS}")
        spec = Fault(kind, count, match, skip, self.stall_seconds if seconds is None else seconds)
        with self.lock:
            self._faults.append(spec)
        return spec

    def clear_faults(self) -> None:
        with self.lock:
            self._faults.clear()

    def _take_fault(self, method: str, target: str) -> Fault | None:
        with self.lock:
            self.requests.append((method, target))
            for spec in self._faults:
                if spec.remaining <= 0 or not spec.matches(f"{method} {target}"):
                    continue
                if spec.skip > 0:
                    spec.skip -= 1
                    continue
                spec.remaining -= 1
                self.faults_fired.append((spec.kind, method, target))
                return spec
        return None

    # store helpers for tests
    def resolve(self, file_id: str) -> StoredFile:
        with self.lock:
            f = self.files.get(self.root_id if file_id == "root" else file_id)
        if f is None:
            raise DriveError(404, "notFound", f"File not found: {file_id}")
        return f

    def children(self, parent_id: str, *, include_trashed: bool = False) -> list[StoredFile]:
        parent = self.resolve(parent_id).id
        with self.lock:
            return [f for f in self.files.values() if parent in f.parents and (include_trashed or not f.trashed)]

    def add_file(
        self, title: str, content: bytes = b"", parent: str = "root", mime_type: str = "application/octet-stream"
    ) -> StoredFile:
        """Seed a file directly (no HTTP)."""
        with self.lock:
            f = StoredFile(_new_id(), title, mime_type, [self.resolve(parent).id], content)
            self.files[f.id] = f
            return f

    def used_bytes(self) -> int:
        with self.lock:
            return sum(len(f.content) for f in self.files.values())

    # resource rendering
    def resource(self, f: StoredFile) -> dict[str, Any]:
        res: dict[str, Any] = {
            **f.extra,
            "kind": "drive#file",
            "id": f.id,
            "etag": f'"{f.id}/{f.version}"',
            "selfLink": f"{self.base_url}/drive/v2/files/{f.id}",
            "title": f.title,
            "mimeType": f.mime_type,
            "labels": {"starred": False, "hidden": False, "trashed": f.trashed, "restricted": False, "viewed": True},
            "explicitlyTrashed": f.explicitly_trashed,
            "createdDate": f.created,
            "modifiedDate": f.modified,
            "version": str(f.version),
            "parents": [
                {"kind": "drive#parentReference", "id": p, "isRoot": p == self.root_id} for p in f.parents
            ],
            "editable": True,
            "copyable": not f.is_folder,
            "quotaBytesUsed": str(len(f.content)),
        }
        if not f.mime_type.startswith("application/vnd.google-apps."):
            res.update(
                md5Checksum=f.md5,
                fileSize=str(len(f.content)),
                originalFilename=f.title,
                downloadUrl=f"{self.base_url}/drive/v2/files/{f.id}?alt=media&source=downloadUrl",
            )
        return res

    # request handling (called from handler threads)
    def dispatch(self, method: str, target: str, headers: Any, body: bytes) -> Reply:
        try:
            return self._route(method, target, headers, body)
        except DriveError as e:
            return e.reply
        except Exception:  # a bug in the fake: answer 500 but make the test fail loudly
            tb = traceback.format_exc()
            with self.lock:
                self.server_errors.append(tb)
            return _error(500, "internalError", tb.splitlines()[-1])

    def _route(self, method: str, target: str, headers: Any, body: bytes) -> Reply:
        url = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        path = url.path
        if path.startswith("/resumable/upload/"):  # discovery's alternative resumable path; same semantics
            path = path[len("/resumable") :]
        if path.startswith("/upload/") and "upload_id" in query:
            # The session URL is the credential for resumable uploads; no bearer token needed.
            return self._session_put(query["upload_id"], headers, body)
        if self.token is not None and headers.get("Authorization") != f"Bearer {self.token}":
            return _error(401, "authError", "Invalid Credentials")
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:3] == ["upload", "drive", "v2"] and parts[3:4] == ["files"] and len(parts) <= 5:
            file_id = parts[4] if len(parts) == 5 else None
            if (method, file_id is None) not in {("POST", True), ("PUT", False)}:
                raise DriveError(405, "methodNotAllowed", f"{method} not allowed on {path}")
            return self._upload_start(file_id, query, headers, body)
        if parts[:2] != ["drive", "v2"]:
            raise DriveError(404, "notFound", f"No such endpoint: {path}")
        rest = parts[2:]
        if rest == ["about"] and method == "GET":
            return self._about()
        if rest == ["files"]:
            if method == "GET":
                return self._list(query)
            if method == "POST":
                return self._insert(self._json(body), b"", None)
        if len(rest) == 2 and rest[0] == "files":
            if method == "GET":
                return self._get(rest[1], query, headers)
            if method in ("PUT", "PATCH"):
                return self._update_metadata(rest[1], self._json(body), query)
            if method == "DELETE":
                return self._delete(rest[1])
        if len(rest) == 3 and rest[0] == "files" and method == "POST" and rest[2] in ("trash", "untrash"):
            return self._set_trashed(rest[1], rest[2] == "trash")
        raise DriveError(404, "notFound", f"No such endpoint: {method} {path}")

    @staticmethod
    def _json(body: bytes) -> dict[str, Any]:
        if not body.strip():
            return {}
        try:
            data = json.loads(body)
        except ValueError as e:
            raise DriveError(400, "parseError", f"Parse Error: {e}") from None
        if not isinstance(data, dict):
            raise DriveError(400, "parseError", "Body must be a JSON object")
        return data

    def _about(self) -> Reply:
        used = self.used_bytes()
        about = {"kind": "drive#about", "rootFolderId": self.root_id, "quotaBytesUsed": str(used),
                 "quotaBytesTotal": str(self.quota_bytes if self.quota_bytes is not None else 15 * 2**30),
                 "user": {"kind": "drive#user", "displayName": "Fake User", "emailAddress": "fake@example.com"}}
        return _json_reply(about)

    def _list(self, query: dict[str, str]) -> Reply:
        clauses = parse_query(query.get("q", ""))
        with self.lock:
            listed = [f for f in self.files.values() if f.id != self.root_id]  # the root is nobody's child
            matched = [self.resource(f) for f in listed if self._match(f, clauses)]
        max_results = max(1, min(int(query.get("maxResults") or 100), 1000))
        start = int(query.get("pageToken") or 0)  # page tokens are opaque to clients; an offset is enough here
        page = matched[start : start + max_results]
        result: dict[str, Any] = {"kind": "drive#fileList", "etag": '"fake"', "items": page}
        if start + max_results < len(matched):
            result["nextPageToken"] = str(start + max_results)
        return _json_reply(result)

    def _match(self, f: StoredFile, clauses: list[tuple[str, ...]]) -> bool:
        for kind, *args in clauses:
            if kind == "parent":
                if self.resolve(args[0]).id not in f.parents:
                    return False
            elif kind == "trashed":
                op, value = args
                if (f.trashed == (value.lower() == "true")) != (op == "="):
                    return False
            else:
                name, op, value = args
                actual = f.title if name == "title" else f.mime_type
                ok = value in actual if op == "contains" else actual == value
                if ok != (op != "!="):
                    return False
        return True

    def _get(self, file_id: str, query: dict[str, str], headers: Any) -> Reply:
        f = self.resolve(file_id)
        if query.get("alt") != "media":
            return _json_reply(self.resource(f))
        if f.mime_type.startswith("application/vnd.google-apps."):
            raise DriveError(403, "fileNotDownloadable", "Only files with binary content can be downloaded.")
        content, total = f.content, len(f.content)
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", headers.get("Range") or "")
        if not m:
            return Reply(200, content, {"Content-Type": f.mime_type})
        first = int(m.group(1))
        last = min(int(m.group(2)) if m.group(2) else total - 1, total - 1)
        if first >= total:  # includes every range on an empty file; googleapiclient expects 416 + bytes */0
            return Reply(416, b"", {"Content-Range": f"bytes */{total}"})
        return Reply(206, content[first : last + 1], {"Content-Type": f.mime_type,
                                                     "Content-Range": f"bytes {first}-{last}/{total}"})

    def _check_quota(self, new_size: int, replacing: str | None = None) -> None:
        if self.quota_bytes is None:
            return
        with self.lock:
            freed = len(self.files[replacing].content) if replacing in self.files else 0
            if self.used_bytes() - freed + new_size > self.quota_bytes:
                reason, message = STATUS_FAULTS["storageQuotaExceeded"][1:]
                raise DriveError(403, reason, message)

    def _parent_ids(self, metadata: dict[str, Any]) -> list[str] | None:
        if "parents" not in metadata:
            return None
        ids = [p["id"] if isinstance(p, dict) else p for p in metadata["parents"]]
        return [self.resolve(i).id for i in ids]

    def _apply_metadata(self, f: StoredFile, metadata: dict[str, Any]) -> None:
        for key, value in metadata.items():
            if key == "title":
                f.title = str(value)
            elif key == "mimeType" and value:
                f.mime_type = str(value)
            elif key == "labels" and isinstance(value, dict) and "trashed" in value:
                self._trash_tree(f, bool(value["trashed"]))
            elif key not in ("parents", "id", "kind", "md5Checksum", "fileSize", "labels", "etag", "version"):
                f.extra[key] = value

    def _insert(self, metadata: dict[str, Any], content: bytes, mime_type: str | None) -> Reply:
        self._check_quota(len(content))
        parents = self._parent_ids(metadata) or [self.root_id]
        with self.lock:
            f = StoredFile(_new_id(), "Untitled", mime_type or "application/octet-stream", parents, content)
            self._apply_metadata(f, metadata)
            self.files[f.id] = f
            return _json_reply(self.resource(f))

    def _update_metadata(self, file_id: str, metadata: dict[str, Any], query: dict[str, str]) -> Reply:
        f = self.resolve(file_id)
        parents = self._parent_ids(metadata)
        add = [self.resolve(p).id for p in query.get("addParents", "").split(",") if p]
        remove = [self.resolve(p).id for p in query.get("removeParents", "").split(",") if p]
        with self.lock:
            self._apply_metadata(f, metadata)
            if parents is not None:
                f.parents = parents
            f.parents = [p for p in f.parents if p not in remove] + [p for p in add if p not in f.parents]
            self._touch(f)
            return _json_reply(self.resource(f))

    @staticmethod
    def _touch(f: StoredFile) -> None:
        f.modified = _now()
        f.version += 1

    def _descendants(self, f: StoredFile) -> list[StoredFile]:
        found, frontier = [], [f.id]
        while frontier:
            parent = frontier.pop()
            for child in self.files.values():
                if parent in child.parents:
                    found.append(child)
                    frontier.append(child.id)
        return found

    def _trash_tree(self, f: StoredFile, trashed: bool) -> None:
        # Trashing a folder trashes its contents implicitly (explicitlyTrashed stays False for them).
        f.trashed = f.explicitly_trashed = trashed
        for child in self._descendants(f):
            if not child.explicitly_trashed:
                child.trashed = trashed

    def _set_trashed(self, file_id: str, trashed: bool) -> Reply:
        f = self.resolve(file_id)
        with self.lock:
            self._trash_tree(f, trashed)
            self._touch(f)
            return _json_reply(self.resource(f))

    def _delete(self, file_id: str) -> Reply:
        f = self.resolve(file_id)
        if f.id == self.root_id:
            raise DriveError(403, "cannotDeleteRoot", "The root folder cannot be deleted.")
        with self.lock:
            for gone in [f, *self._descendants(f)]:  # deleting a folder deletes what is inside it
                self.files.pop(gone.id, None)
        return Reply(204)

    # uploads
    def _upload_start(self, file_id: str | None, query: dict[str, str], headers: Any, body: bytes) -> Reply:
        if file_id is not None:
            file_id = self.resolve(file_id).id
        upload_type = query.get("uploadType", "media")
        if upload_type == "resumable":
            declared = headers.get("X-Upload-Content-Length")
            total = int(declared) if declared else None
            self._check_quota(total or 0, replacing=file_id)
            mime = headers.get("X-Upload-Content-Type") or "application/octet-stream"
            session = _UploadSession(file_id, self._json(body), mime, total)
            sid = secrets.token_urlsafe(16)
            with self.lock:
                self._sessions[sid] = session
            path = "/upload/drive/v2/files" + (f"/{file_id}" if file_id else "")
            return Reply(200, b"", {"Location": f"{self.base_url}{path}?uploadType=resumable&upload_id={sid}"})
        if upload_type == "multipart":
            metadata, content, mime = self._parse_multipart(headers.get("Content-Type", ""), body)
        elif upload_type == "media":
            metadata, content, mime = {}, body, headers.get("Content-Type")
        else:
            raise DriveError(400, "invalid", f"Unsupported uploadType {upload_type!r}")
        return self._commit_upload(file_id, metadata, content, mime)

    def _parse_multipart(self, content_type: str, body: bytes) -> tuple[dict[str, Any], bytes, str | None]:
        m = re.search(r'boundary="?([^";]+)"?', content_type)
        if not m:
            raise DriveError(400, "badContent", "multipart body without boundary")
        parts = []
        for raw in body.split(b"--" + m.group(1).encode())[1:-1]:
            raw = re.sub(rb"\A\r?\n", b"", raw)
            head, _, payload = re.split(rb"(\r?\n\r?\n)", raw, maxsplit=1)
            # The line break before the next delimiter belongs to the delimiter, not the payload.
            payload = re.sub(rb"\r?\n\Z", b"", payload)
            mime = re.search(rb"(?im)^content-type:\s*([^\s;]+)", head)
            parts.append((mime.group(1).decode() if mime else None, payload))
        if len(parts) != 2:
            raise DriveError(400, "badContent", f"expected 2 multipart parts, got {len(parts)}")
        return self._json(parts[0][1]), parts[1][1], parts[1][0]

    def _commit_upload(self, file_id: str | None, metadata: dict[str, Any], content: bytes, mime: str | None) -> Reply:
        if file_id is None:
            return self._insert(metadata, content, mime)
        self._check_quota(len(content), replacing=file_id)
        f = self.resolve(file_id)
        parents = self._parent_ids(metadata)
        with self.lock:
            f.content = content
            self._apply_metadata(f, metadata)
            if parents is not None:
                f.parents = parents
            self._touch(f)
            return _json_reply(self.resource(f))

    def _session_range(self, session: _UploadSession) -> Reply:
        headers = {"Range": f"bytes=0-{len(session.data) - 1}"} if session.data else {}
        return Reply(308, b"", headers)

    def _session_put(self, sid: str, headers: Any, body: bytes) -> Reply:
        with self.lock:  # one lock for the whole step: a session's bytes, total and completion change together
            session = self._sessions.get(sid)
            if session is None:
                raise DriveError(404, "notFound", "Upload session not found or expired")
            if session.done_id is not None:
                return _json_reply(self.resource(self.resolve(session.done_id)))
            content_range = headers.get("Content-Range") or ""
            status_query = re.fullmatch(r"bytes \*/(\d+|\*)", content_range)
            chunk = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range)
            if status_query:
                total_text = status_query.group(1)
            elif chunk:
                first, last, total_text = int(chunk.group(1)), int(chunk.group(2)), chunk.group(3)
                if last - first + 1 != len(body):
                    raise DriveError(400, "badRequest", f"Content-Range {content_range} but {len(body)} body bytes")
                if first > len(session.data):
                    raise DriveError(400, "badRequest", f"gap: have {len(session.data)} bytes, chunk starts at {first}")
                fresh = body[len(session.data) - first :]  # overlap with committed bytes is allowed
                if self.upload_chunk_limit is not None:
                    fresh = fresh[: self.upload_chunk_limit]
                session.data += fresh
            elif not content_range and not body:  # googleapiclient's zero-byte upload sends no Content-Range
                total_text = "0"
            else:
                raise DriveError(400, "badRequest", f"Bad Content-Range {content_range!r}")
            if total_text != "*":
                session.total = int(total_text)
            if session.total is None or len(session.data) < session.total:
                return self._session_range(session)
            if len(session.data) > session.total:
                raise DriveError(400, "badRequest", f"received {len(session.data)} bytes, more than {session.total}")
            reply = self._commit_upload(session.file_id, session.metadata, bytes(session.data), session.mime_type)
            session.done_id = json.loads(reply.body)["id"]
            return reply

    def absorb_partial(self, target: str, headers: Any, partial: bytes) -> None:
        """A chunk cut off by a dropped connection: keep the bytes that arrived, as a real server may."""
        query = parse_qs(urlsplit(target).query)
        chunk = re.fullmatch(r"bytes (\d+)-\d+/(?:\d+|\*)", headers.get("Content-Range") or "")
        if "upload_id" not in query or not chunk or not partial:
            return
        first = int(chunk.group(1))
        fake_headers = {"Content-Range": f"bytes {first}-{first + len(partial) - 1}/*"}
        self.dispatch("PUT", target, fake_headers, partial)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # keep-alive client connections must not block stop()
    drive: FakeDrive

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # a client hung up or reset (timeouts, drop tests): routine, not a bug
            return
        with self.drive.lock:
            self.drive.server_errors.append(traceback.format_exc())


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive, like Google's front end; httplib2 reuses connections
    timeout = 30  # reap idle keep-alive connections instead of leaking threads

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes; without NODELAY, Nagle + delayed ACK add ~40 ms per call.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.drive.lock:
            self.server.drive._connections.add(self.connection)

    def finish(self) -> None:
        with self.server.drive.lock:
            self.server.drive._connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # pytest output stays clean; FakeDrive.requests is the log

    def _serve(self) -> None:
        drive: FakeDrive = self.server.drive
        method, target = self.command, self.path
        fault = drive._take_fault(method, target)
        if "upload_id=" in target:
            with drive.lock:
                drive.upload_ranges.append(self.headers.get("Content-Range", ""))
        length = int(self.headers.get("Content-Length") or 0)
        if fault and fault.kind == "drop":
            drive.absorb_partial(target, self.headers, self.rfile.read(length // 2))
            self._reset()
            return
        body = self.rfile.read(length) if length else b""
        if fault and fault.kind == "close":
            self.close_connection = True  # the server then shuts the socket down cleanly, with no reply
            return
        if fault and fault.kind in STATUS_FAULTS:
            reply = _error(*STATUS_FAULTS[fault.kind])
            if fault.kind in ("userRateLimitExceeded", "rateLimitExceeded"):
                reply = Reply(reply.status, error_body(*STATUS_FAULTS[fault.kind], domain="usageLimits"),
                              reply.headers)
        elif fault and fault.kind in HTML_FAULTS:
            status = HTML_FAULTS[fault.kind]
            html = f"<!DOCTYPE html><html><head><title>Error {status}</title></head><body><p><b>{status}.</b> "
            html += "That's an error.</p><p>The server encountered a temporary error.</p></body></html>"
            reply = Reply(status, html.encode(), {"Content-Type": "text/html; charset=UTF-8"})
        else:
            reply = drive.dispatch(method, target, self.headers, body)
            if fault and fault.kind == "stall":
                drive._stop.wait(fault.seconds)  # the change is already applied; only the answer is late
        self._write(drive, reply)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def _write(self, drive: FakeDrive, reply: Reply) -> None:
        # Record first: once the bytes are out, the client may look at FakeDrive.responses before this thread runs on.
        with drive.lock:
            drive.responses.append((self.command, self.path, reply.status))
        try:
            self.send_response(reply.status, _REASON_PHRASES.get(reply.status))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)
            self.wfile.flush()
        except OSError:  # the client gave up (e.g. after a stall); nothing to answer
            self.close_connection = True

    def _reset(self) -> None:
        # SO_LINGER(on, 0) makes close() send RST instead of FIN. The makefile() reader holds a reference to the
        # socket, so close it first or the descriptor (and the connection) would stay open.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.rfile.close()
        self.wfile.close()
        self.connection.close()
        self.rfile, self.wfile = io.BytesIO(), io.BytesIO()  # harmless targets for the server's own teardown
        self.close_connection = True


# --- pointing the real client stack at the fake --------------------------------------------------------------------
class RewritingHttp(httplib2.Http):
    """httplib2.Http that sends every ``https://*.googleapis.com`` request to the fake instead.

    Any other non-loopback host raises, so a test can never reach the real network (e.g. a token refresh).
    """

    def __init__(self, base_url: str, timeout: float | None = 5.0) -> None:
        super().__init__(timeout=timeout)
        self.base_url = base_url.rstrip("/")
        # Drive answers resumable-upload chunks with 308 "Resume Incomplete", which is not a redirect
        # (pydrive2's own _build_http does the same).
        self.redirect_codes = self.redirect_codes - {308}

    def rewrite(self, uri: str) -> str:
        parts = urlsplit(uri)
        host = parts.hostname or ""
        if host == "googleapis.com" or host.endswith(".googleapis.com"):
            return self.base_url + uri[len(f"{parts.scheme}://{parts.netloc}") :]
        if host not in _LOOPBACK:
            raise RuntimeError(f"fake_drive: refusing to contact {host!r} from tests ({uri})")
        return uri

    def request(  # type: ignore[override]
        self,
        uri: str,
        method: str = "GET",
        body: Any = None,
        headers: dict[str, str] | None = None,
        redirections: int = httplib2.DEFAULT_MAX_REDIRECTS,
        connection_type: Any = None,
    ) -> tuple[httplib2.Response, bytes]:
        return super().request(self.rewrite(uri), method, body, headers, redirections, connection_type)


def _base_url(target: FakeDrive | str) -> str:
    return target if isinstance(target, str) else target.base_url


def make_http(fake: FakeDrive | str, timeout: float | None = 5.0, token: str | None = DEFAULT_TOKEN) -> httplib2.Http:
    """A rewriting Http, authorized with a static bearer token unless ``token`` is None."""
    http = RewritingHttp(_base_url(fake), timeout)
    if token is None:
        return http
    return AccessTokenCredentials(token, USER_AGENT).authorize(http)


class FakeGoogleAuth(GoogleAuth):
    """GoogleAuth whose every Http (the shared one and pydrive2's per-thread ones) is a RewritingHttp.

    pydrive2 builds all its Http objects through ``_build_http``, so overriding it is the single injection point.
    Credentials are a static access token with no expiry, so no refresh or OAuth flow ever runs.
    """

    def __init__(self, base_url: str, http_timeout: float | None = 5.0, token: str = DEFAULT_TOKEN) -> None:
        super().__init__(settings_file=None, http_timeout=http_timeout, settings=dict(GoogleAuth.DEFAULT_SETTINGS))
        self.base_url = base_url
        self.credentials = AccessTokenCredentials(token, USER_AGENT)

    def _build_http(self) -> httplib2.Http:
        return RewritingHttp(self.base_url, timeout=self.http_timeout)


def make_gauth(fake: FakeDrive | str, timeout: float | None = 5.0, token: str = DEFAULT_TOKEN) -> FakeGoogleAuth:
    gauth = FakeGoogleAuth(_base_url(fake), http_timeout=timeout, token=token)
    # Builds the v2 service from googleapiclient's bundled discovery document (static_discovery defaults to True).
    gauth.Authorize()
    return gauth


def make_drive(fake: FakeDrive | str, timeout: float | None = 5.0, token: str = DEFAULT_TOKEN) -> GoogleDrive:
    return GoogleDrive(make_gauth(fake, timeout, token))


def make_service(fake: FakeDrive | str, timeout: float | None = 5.0, token: str | None = DEFAULT_TOKEN) -> Any:
    """A raw googleapiclient Drive v2 service talking to the fake."""
    return build("drive", "v2", http=make_http(fake, timeout, token), static_discovery=True, cache_discovery=False)
