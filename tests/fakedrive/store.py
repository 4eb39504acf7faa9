"""The in-memory Drive: files and folders, their Drive v2 JSON rendering, and the mutations every endpoint shares.

Every mutation runs under ``Store.lock`` (an RLock), which the HTTP handler threads, the fault bookkeeping and the
tests all share.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .faults import STATUS_FAULTS
from .replies import DriveError, Reply, json_reply

FOLDER_MIME = "application/vnd.google-apps.folder"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _new_id() -> str:
    # Real Drive ids are ~33 url-safe characters; tests must not depend on their shape.
    return "1" + secrets.token_urlsafe(24)[:32]


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
    born: float = field(default_factory=time.monotonic)  # when it was created, for DriveApi.list_lag_s

    @property
    def is_folder(self) -> bool:
        return self.mime_type == FOLDER_MIME

    @property
    def md5(self) -> str:
        return hashlib.md5(self.content).hexdigest()


class Store:
    """Files keyed by id, with a root folder; ``quota_bytes`` caps the total content size (None: no cap)."""

    def __init__(self, quota_bytes: int | None = None) -> None:
        self.quota_bytes = quota_bytes
        self.lock = threading.RLock()
        self.root_id = "0A" + secrets.token_urlsafe(12)  # real root ids are opaque; 'root' is only an alias
        self.files: dict[str, StoredFile] = {self.root_id: StoredFile(self.root_id, "My Drive", FOLDER_MIME, [])}
        self.generated_ids: set[str] = set()  # from files.generateIds, not used by an insert yet

    def reserve_id(self) -> str:
        with self.lock:
            new = _new_id()
            self.generated_ids.add(new)
            return new

    def _claim_id(self, metadata: dict[str, Any]) -> str:
        """The id of a new file: one the client chose (it must come from generateIds; 409 when a file has it
        already, as Drive answers a retried insert that had landed), else a fresh one."""
        chosen = metadata.get("id")
        if chosen is None:
            return _new_id()
        if chosen in self.files:
            raise DriveError(409, "duplicate", "A file already exists with the provided ID.")
        if chosen not in self.generated_ids:
            raise DriveError(400, "invalid", "The provided file ID is not usable.")
        self.generated_ids.discard(chosen)
        return str(chosen)

    @property
    def base_url(self) -> str:
        """Where the files are served from, for the links in their resources (the server provides it)."""
        raise NotImplementedError

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
        self, title: str, content: bytes = b"", parent: str = "root", mime_type: str = "application/octet-stream",
        modified: str | None = None,
    ) -> StoredFile:
        """Seed a file directly (no HTTP); ``modified``: its modifiedDate (RFC 3339), e.g. to make a duplicate
        title older or newer than the file a client wrote."""
        with self.lock:
            f = StoredFile(_new_id(), title, mime_type, [self.resolve(parent).id], content)
            if modified is not None:
                f.modified = modified
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

    # mutations shared by the metadata endpoints and the uploads
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
            f = StoredFile(self._claim_id(metadata), "Untitled", mime_type or "application/octet-stream", parents,
                           content)
            self._apply_metadata(f, metadata)
            self.files[f.id] = f
            return json_reply(self.resource(f))

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
