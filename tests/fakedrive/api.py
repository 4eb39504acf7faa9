"""The Drive v2 API surface: authorization, routing of METHOD + path to endpoints, and the metadata endpoints.

Uploads are routed to ``Uploads``; everything here runs on the server's handler threads.
"""

from __future__ import annotations

import re
import time
import traceback
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from .query import matches, parse_query
from .replies import DriveError, Reply, error_reply, json_object, json_reply
from .uploads import Uploads


class DriveApi(Uploads):
    """Request dispatch over the store.

    token: bearer token every API call must carry (None disables the check).
    """

    faults_fired: list[tuple[str, str, str]]  # shared with FaultInjector (FakeDrive is both)
    server_errors: list[str]  # tracebacks of bugs in the fake itself (the log is set up by FakeDrive)

    def __init__(
        self, *, token: str | None, quota_bytes: int | None = None, upload_chunk_limit: int | None = None
    ) -> None:
        super().__init__(quota_bytes=quota_bytes, upload_chunk_limit=upload_chunk_limit)
        self.token = token
        # Drive's documented behaviour, off by default:
        self.max_page: int | None = None  # at most this many items per files.list page, whatever maxResults asks
        self.list_lag_s = 0.0  # files.list omits files created less than this long ago (get by id sees them)
        self.corrupt_first_download = False  # each file's first media download has one byte flipped
        self._downloaded: set[str] = set()

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
            return error_reply(500, "internalError", tb.splitlines()[-1])

    def absorb_partial(self, target: str, headers: Any, partial: bytes) -> None:
        """A chunk cut off by a dropped connection: keep the bytes that arrived, as a real server may."""
        query = parse_qs(urlsplit(target).query)
        chunk = re.fullmatch(r"bytes (\d+)-\d+/(?:\d+|\*)", headers.get("Content-Range") or "")
        if "upload_id" not in query or not chunk or not partial:
            return
        first = int(chunk.group(1))
        fake_headers = {"Content-Range": f"bytes {first}-{first + len(partial) - 1}/*"}
        self.dispatch("PUT", target, fake_headers, partial)

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
            return error_reply(401, "authError", "Invalid Credentials")
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
                return self._insert(json_object(body), b"", None)
        if rest == ["files", "generateIds"] and method == "GET":
            return self._generate_ids(query)
        if len(rest) == 2 and rest[0] == "files":
            if method == "GET":
                return self._get(rest[1], query, headers)
            if method in ("PUT", "PATCH"):
                return self._update_metadata(rest[1], json_object(body), query)
            if method == "DELETE":
                return self._delete(rest[1])
        if len(rest) == 3 and rest[0] == "files" and method == "POST" and rest[2] in ("trash", "untrash"):
            return self._set_trashed(rest[1], rest[2] == "trash")
        raise DriveError(404, "notFound", f"No such endpoint: {method} {path}")

    # endpoints
    def _about(self) -> Reply:
        used = self.used_bytes()
        about = {"kind": "drive#about", "rootFolderId": self.root_id, "quotaBytesUsed": str(used),
                 "quotaBytesTotal": str(self.quota_bytes if self.quota_bytes is not None else 15 * 2**30),
                 "user": {"kind": "drive#user", "displayName": "Fake User", "emailAddress": "fake@example.com"}}
        return json_reply(about)

    def _list(self, query: dict[str, str]) -> Reply:
        clauses = parse_query(query.get("q", ""))
        with self.lock:
            seen = time.monotonic() - self.list_lag_s
            listed = [f for f in self.files.values() if f.id != self.root_id and f.born <= seen]  # root: no one's child
            matched = [self.resource(f) for f in listed if matches(f, clauses, self.resolve)]
        max_results = max(1, min(int(query.get("maxResults") or 100), 1000, self.max_page or 1000))
        start = int(query.get("pageToken") or 0)  # page tokens are opaque to clients; an offset is enough here
        page = matched[start : start + max_results]
        result: dict[str, Any] = {"kind": "drive#fileList", "etag": '"fake"', "items": page}
        if start + max_results < len(matched):
            result["nextPageToken"] = str(start + max_results)
        return json_reply(result)

    def _generate_ids(self, query: dict[str, str]) -> Reply:
        """files.generateIds: ids a later insert may carry as its "id" (Drive v2; maxResults 1..1000, default 10)."""
        try:
            count = int(query.get("maxResults") or 10)
        except ValueError:
            raise DriveError(400, "invalid", f"Invalid value for maxResults: {query.get('maxResults')!r}") from None
        if not 1 <= count <= 1000:
            raise DriveError(400, "invalid", f"maxResults must be between 1 and 1000, not {count}")
        if query.get("space", "drive") != "drive":
            raise DriveError(400, "invalid", f"Unsupported space {query.get('space')!r}")
        ids = [self.reserve_id() for _ in range(count)]
        return json_reply({"kind": "drive#generatedIds", "space": "drive", "ids": ids})

    def _get(self, file_id: str, query: dict[str, str], headers: Any) -> Reply:
        f = self.resolve(file_id)
        if query.get("alt") != "media":
            return json_reply(self.resource(f))
        if f.mime_type.startswith("application/vnd.google-apps."):
            raise DriveError(403, "fileNotDownloadable", "Only files with binary content can be downloaded.")
        content, total = f.content, len(f.content)
        with self.lock:
            first_time = f.id not in self._downloaded
            self._downloaded.add(f.id)
        if self.corrupt_first_download and first_time and content:  # same length, one byte flipped
            content = bytes([content[0] ^ 0xFF]) + content[1:]
            self.faults_fired.append(("corrupt", "GET", f.title))
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", headers.get("Range") or "")
        if not m:
            return Reply(200, content, {"Content-Type": f.mime_type})
        first = int(m.group(1))
        last = min(int(m.group(2)) if m.group(2) else total - 1, total - 1)
        if first >= total:  # includes every range on an empty file; googleapiclient expects 416 + bytes */0
            return Reply(416, b"", {"Content-Range": f"bytes */{total}"})
        return Reply(206, content[first : last + 1], {"Content-Type": f.mime_type,
                                                     "Content-Range": f"bytes {first}-{last}/{total}"})

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
            return json_reply(self.resource(f))

    def _set_trashed(self, file_id: str, trashed: bool) -> Reply:
        f = self.resolve(file_id)
        with self.lock:
            self._trash_tree(f, trashed)
            self._touch(f)
            return json_reply(self.resource(f))

    def _delete(self, file_id: str) -> Reply:
        f = self.resolve(file_id)
        if f.id == self.root_id:
            raise DriveError(403, "cannotDeleteRoot", "The root folder cannot be deleted.")
        with self.lock:
            for gone in [f, *self._descendants(f)]:  # deleting a folder deletes what is inside it
                self.files.pop(gone.id, None)
        return Reply(204)
