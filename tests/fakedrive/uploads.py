"""Content uploads: simple (media), multipart, and resumable sessions with 308 "Resume Incomplete" replies."""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from .replies import DriveError, Reply, json_object, json_reply
from .store import Store

GOOGLE_API = "https://www.googleapis.com"


@dataclass
class _UploadSession:
    file_id: str | None  # None: create a new file on completion; else replace that file's content
    metadata: dict[str, Any]
    mime_type: str
    total: int | None
    data: bytearray = field(default_factory=bytearray)
    done_id: str | None = None  # set once complete, so a status query after a lost reply still gets 200


class Uploads(Store):
    """The upload endpoints on top of the store.

    upload_chunk_limit: commit at most this many bytes per resumable PUT and answer 308, as real Drive may; this
        forces multi-request uploads even though pydrive2 always sends 100 MiB chunks.
    """

    def __init__(self, *, quota_bytes: int | None = None, upload_chunk_limit: int | None = None) -> None:
        super().__init__(quota_bytes)
        self.upload_chunk_limit = upload_chunk_limit
        self._sessions: dict[str, _UploadSession] = {}
        self._expired: dict[str, int] = {}  # session id -> the status it answers now (404 or 410)
        self.commits: list[tuple[float, str, str]] = []  # (time.time(), title, id) of each upload that completed

    def expire_upload_sessions(self, status: int = 404) -> None:
        """Every open resumable session expires (Drive keeps one for about a week): it answers ``status`` now."""
        with self.lock:
            self._expired.update(dict.fromkeys(self._sessions, status))
            self._sessions.clear()

    def _upload_start(self, file_id: str | None, query: dict[str, str], headers: Any, body: bytes) -> Reply:
        if file_id is not None:
            file_id = self.resolve(file_id).id
        upload_type = query.get("uploadType", "media")
        if upload_type == "resumable":
            declared = headers.get("X-Upload-Content-Length")
            total = int(declared) if declared else None
            self._check_quota(total or 0, replacing=file_id)
            mime = headers.get("X-Upload-Content-Type") or "application/octet-stream"
            session = _UploadSession(file_id, json_object(body), mime, total)
            sid = secrets.token_urlsafe(16)
            with self.lock:
                self._sessions[sid] = session
            path = "/upload/drive/v2/files" + (f"/{file_id}" if file_id else "")
            # Real Drive answers with its own host; the client's endpoint rewriting brings it back here (through
            # any fault proxy in between), and resumable only continues sessions on the API's upload host.
            return Reply(200, b"", {"Location": f"{GOOGLE_API}{path}?uploadType=resumable&upload_id={sid}"})
        if upload_type == "multipart":
            metadata, content, mime = self._parse_multipart(headers.get("Content-Type", ""), body)
        elif upload_type == "media":
            metadata, content, mime = {}, body, headers.get("Content-Type")
        else:
            raise DriveError(400, "invalid", f"Unsupported uploadType {upload_type!r}")
        return self._commit_upload(file_id, metadata, content, mime)

    @staticmethod
    def _parse_multipart(content_type: str, body: bytes) -> tuple[dict[str, Any], bytes, str | None]:
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
        return json_object(parts[0][1]), parts[1][1], parts[1][0]

    def _commit_upload(self, file_id: str | None, metadata: dict[str, Any], content: bytes, mime: str | None) -> Reply:
        reply = self._replace(file_id, metadata, content, mime) if file_id else self._insert(metadata, content, mime)
        if reply.status == 200:
            resource = json.loads(reply.body)
            with self.lock:
                self.commits.append((time.time(), resource["title"], resource["id"]))
        return reply

    def _replace(self, file_id: str, metadata: dict[str, Any], content: bytes, mime: str | None) -> Reply:
        self._check_quota(len(content), replacing=file_id)
        f = self.resolve(file_id)
        parents = self._parent_ids(metadata)
        with self.lock:
            f.content = content
            self._apply_metadata(f, metadata)
            if parents is not None:
                f.parents = parents
            self._touch(f)
            return json_reply(self.resource(f))

    @staticmethod
    def _session_range(session: _UploadSession) -> Reply:
        headers = {"Range": f"bytes=0-{len(session.data) - 1}"} if session.data else {}
        return Reply(308, b"", headers)

    def _session_put(self, sid: str, headers: Any, body: bytes) -> Reply:
        with self.lock:  # one lock for the whole step: a session's bytes, total and completion change together
            session = self._sessions.get(sid)
            if sid in self._expired:
                raise DriveError(self._expired[sid], "notFound" if self._expired[sid] == 404 else "gone",
                                 "Upload session expired")
            if session is None:
                raise DriveError(404, "notFound", "Upload session not found or expired")
            if session.done_id is not None:
                return json_reply(self.resource(self.resolve(session.done_id)))
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
            session.data = bytearray()  # committed to the file; a status query now answers with the file
            return reply
