"""Google Drive API storage through pydrive2, made boring: retries, timeouts, no duplicates, no trash.

pydrive2 itself never retries, has no HTTP timeout unless given one, creates a second file when a name
is uploaded again, and raises a bare JSONDecodeError on a non-JSON error body. Here every call is
retried on transient errors (403 rate limits, 429, 5xx, resets, timeouts, HTML bodies) with backoff and
jitter; files are found by ``'<id>' in parents`` queries (every page) and overwritten by id; of same-titled
copies the same one is always read and written (drivelist.py); folders are created with ids from
``files.generateIds``, so a create retried after a lost answer finds its folder instead of making a second one;
folders are deleted permanently; ``storageQuotaExceeded`` is reported, never retried.

A Drive title is any string (``../../x``, ``a/b``), and a shared folder may be written by anyone: listings show
only titles that are plain file names (checkpoint/paths.py; the others are skipped with one warning each), names
handed in must be plain, and titles in a query are escaped.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint import paths
from . import drivelist
from .base import CHECKPOINTS, RemoteFile, folder_parts
from .retry import MissingFile, RetryPolicy, StorageError, TransientStorageError
from .upload import DEFAULT_CHUNK, ResumableUpload, SessionRecords, Target

SCHEME = "gdrive://"
FOLDER_MIME = "application/vnd.google-apps.folder"
_RETRY_REASONS = {"userRateLimitExceeded", "rateLimitExceeded", "backendError", "internalError"}


@dataclass(frozen=True)
class DriveLocation:
    root_id: str  # a folder id, or "root" for My Drive
    path: tuple[str, ...]

    @classmethod
    def parse(cls, url: str) -> DriveLocation:
        """``gdrive://<folder-id or root>/<sub/path>`` → location.

        >>> DriveLocation.parse("gdrive://root/runs/t")
        DriveLocation(root_id='root', path=('runs', 't'))
        """
        if not url.startswith(SCHEME):
            raise ValueError(f"{url!r} is not a gdrive:// URL")
        parts = [p for p in url[len(SCHEME):].split("/") if p]
        if not parts:
            raise ValueError(f"{url!r} names no folder; use gdrive://root/<path> or gdrive://<folder-id>/<path>")
        for part in parts:
            if part in (".", "..") or "'" in part or "\\" in part:
                raise ValueError(f"{url!r}: folder name {part!r} is not allowed")
        return cls(parts[0], tuple(parts[1:]))


def is_drive_url(run_dir: str) -> bool:
    return str(run_dir).startswith(SCHEME)


# A Drive URL typed a little wrong is still a legal local path ("gdrive:/x" is the folder x in a folder named
# "gdrive:"), so it used to train into that local folder and never reach Drive. These near misses are refused:
# one slash or none after the colon (gdrive:/x, gdrive:x), the scheme in capitals (GDrive://x), the colon left out
# (gdrive//x) and other names for Drive (drive://x, googledrive://x, google-drive:x). A plain relative folder
# (gdrive/x, drive/x) is not one, nor is anything written as a path (./gdrive:/x). gdrive:///x is a Drive URL
# already (empty names are skipped: folder id x).
_NEAR_MISS = re.compile(r"(?:g?drive|google[-_]?drive)(?::/*|//+)(?P<rest>.*)", re.IGNORECASE | re.DOTALL)


def misspelt_drive_url(run_dir: str) -> str | None:
    """The gdrive:// URL that ``run_dir`` misspells (see ``_NEAR_MISS``), or None.

    >>> misspelt_drive_url("gdrive:/root/runs/x")
    'gdrive://root/runs/x'
    >>> misspelt_drive_url("gdrive/x") is None
    True
    """
    text = str(run_dir)
    match = None if is_drive_url(text) else _NEAR_MISS.fullmatch(text.strip())
    if match is None:
        return None
    return SCHEME + (match["rest"].lstrip("/") or "root/<folder>")


def _http_status(error: BaseException) -> tuple[int | None, str]:
    """(status, reason) of a googleapiclient/pydrive2 error, also when the body was not JSON."""
    from googleapiclient.errors import HttpError
    from pydrive2.files import ApiRequestError

    if isinstance(error, ApiRequestError):
        errors = error.error.get("errors") or [{}]
        return error.error.get("code"), str(errors[0].get("reason", ""))
    # pydrive2 parses every error body as JSON: an HTML body turns into a JSONDecodeError raised while the
    # HttpError was being handled, so the HttpError is found down the __context__ chain.
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, HttpError):
        cause = cause.__context__
    if isinstance(cause, HttpError):
        reason = ""
        try:
            body = json.loads(cause.content.decode("utf-8"))
            reason = str(((body.get("error") or {}).get("errors") or [{}])[0].get("reason", ""))
        except (ValueError, AttributeError, UnicodeDecodeError):
            reason = "non-JSON error body"
        return int(cause.resp.status), reason
    return None, ""


def classify(error: BaseException) -> StorageError | None:
    """Map an exception from pydrive2/googleapiclient/httplib2 to a storage error (None: not one)."""
    status, reason = _http_status(error)
    if status is not None:
        if reason == "storageQuotaExceeded":
            return StorageError("the Drive storage quota is exceeded (storageQuotaExceeded): free space in "
                                "Drive (and empty its trash) or mirror to another account; checkpoints stay "
                                "committed locally")
        if status in (429, 500, 502, 503, 504) or (status == 403 and reason in _RETRY_REASONS):
            return TransientStorageError(f"HTTP {status} {reason}".strip())
        if status == 404:
            return MissingFile(f"HTTP 404 {reason}".strip())
        return StorageError(f"HTTP {status} {reason}".strip())
    if isinstance(error, (TimeoutError, socket.timeout, ConnectionError, http.client.HTTPException)):
        return TransientStorageError(f"{type(error).__name__}: {error}")
    if isinstance(error, OSError) or type(error).__module__.startswith("httplib2"):
        return TransientStorageError(f"{type(error).__name__}: {error}")
    return None


class GDriveStore:
    """A run folder on Google Drive: ``<location>/checkpoints/step-*/...`` plus run-level files."""

    prune_grace_s = 0.0  # an upload that returned (size and md5 checked) is stored by Drive: prune at once

    def __init__(self, drive: Any, location: DriveLocation, policy: RetryPolicy | None = None,
                 url: str = "", sessions_dir: Path | None = None, chunk_size: int = DEFAULT_CHUNK) -> None:
        """sessions_dir: where the session of an unfinished upload is kept, so that the next process on this
        machine continues it (upload.py); None: an upload cut by the process dying starts over."""
        self.drive = drive  # a pydrive2 GoogleDrive
        self.location = location
        self.policy = policy or RetryPolicy()
        self.description = f"Google Drive {url or 'gdrive://' + '/'.join((location.root_id, *location.path))}"
        self._folders: dict[tuple[str, ...], str] = {}
        self._written: dict[tuple[str, str], str] = {}  # (parent id, name) -> id of the file this store wrote
        self._ids: list[str] = []  # ids from files.generateIds not used yet
        self.uploads = ResumableUpload(drive, self.policy, classify, SessionRecords(sessions_dir), chunk_size)

    # -- low level ---------------------------------------------------------------------------------
    def _call(self, action, what: str):
        return self.policy.call(action, classify, f"{what} on {self.description}")

    def _children(self, parent_id: str, title: str | None = None, folders: bool | None = None) -> list[Any]:
        clauses = [f"'{parent_id}' in parents", "trashed=false"]
        if title is not None:  # escaped: a quote in a name must not end the string and change the query
            clauses.append("title='" + title.replace("\\", "\\\\").replace("'", "\\'") + "'")
        if folders is True:
            clauses.append(f"mimeType='{FOLDER_MIME}'")
        elif folders is False:
            clauses.append(f"mimeType!='{FOLDER_MIME}'")
        query = {"q": " and ".join(clauses), "maxResults": 1000}
        # Every page: Drive may answer with fewer items than asked and a nextPageToken (pydrive2's GetList()
        # stops after the first page when maxResults is given). A retry lists again from the first page.
        return self._call(lambda: drivelist.every_page(self.drive, query), f"listing {title or parent_id}")

    def _service(self) -> Any:
        if self.drive.auth.service is None:
            self.drive.auth.Authorize()
        return self.drive.auth.service

    def _folder_id(self, parts: tuple[str, ...], create: bool) -> str | None:
        if not parts:
            return self.location.root_id
        if parts in self._folders:
            return self._folders[parts]
        parent = self._folder_id(parts[:-1], create)
        if parent is None:
            return None
        found = drivelist.oldest_folder(self._children(parent, parts[-1], folders=True),
                                        f"{'/'.join(parts[:-1]) or 'the top folder'} on {self.description}")
        if found:
            folder_id = found["id"]
        elif create:
            folder_id = self._create_folder(parent, parts)
        else:
            return None
        self._folders[parts] = folder_id
        return folder_id

    def _new_id(self) -> str:
        if not self._ids:  # a few at a time: a run creates one folder per checkpoint
            got = self._call(lambda: self._service().files().generateIds(maxResults=10, space="drive").execute(
                http=self.uploads.http()), "reserving file ids")
            ids = got.get("ids") if isinstance(got, dict) else None
            if not isinstance(ids, list) or not ids or not all(isinstance(i, str) and i for i in ids):
                raise StorageError(f"files.generateIds on {self.description} answered {got!r}, not a list of ids")
            self._ids.extend(ids)
        return self._ids.pop()

    def _create_folder(self, parent: str, parts: tuple[str, ...]) -> str:
        """Create a folder with an id chosen beforehand. When the answer to the create is lost, the retry sends
        the same id: Drive answers 409 for an id that exists, which means the first try landed. Listing again to
        find it would not do: a listing lags behind a create, so the retry would make a second folder."""
        from googleapiclient.errors import HttpError

        new_id = self._new_id()
        body = {"id": new_id, "title": parts[-1], "mimeType": FOLDER_MIME, "parents": [{"id": parent}]}

        def make() -> str:
            try:
                return self._service().files().insert(body=body).execute(http=self.uploads.http())["id"]
            except HttpError as e:
                if int(e.resp.status) == 409:  # this id exists: our earlier try created it
                    return new_id
                raise

        return self._call(make, f"creating folder {'/'.join(parts)}")

    def _parts(self, folder: str) -> tuple[str, ...]:
        return self.location.path + folder_parts(folder)

    # -- RemoteStore -------------------------------------------------------------------------------
    def list_checkpoints(self) -> list[str]:
        parent = self._folder_id(self.location.path + (CHECKPOINTS,), create=False)
        if parent is None:
            return []
        return sorted(f["title"] for f in self._children(parent, folders=True) if self._plain_title(f, CHECKPOINTS))

    def list_files(self, folder: str) -> dict[str, RemoteFile]:
        parent = self._folder_id(self._parts(folder), create=False)
        if parent is None:
            return {}
        try:
            children = self._children(parent, folders=False)
        except MissingFile:  # deleted since its id was cached (e.g. pruned by the training process)
            self._folders.pop(self._parts(folder), None)
            raise
        files: dict[str, RemoteFile] = {}
        for item in sorted(children, key=drivelist.newest_key):  # of same-titled copies the newest, as get_file
            if not self._plain_title(item, folder or "the run folder"):
                continue
            try:
                size = int(item.get("fileSize", 0))
            except (TypeError, ValueError):
                where = folder or "the run folder"
                paths.warn_once(f"drive-size:{item.get('id')}", f"skipping {item['title']!r} in {where} on "
                                f"{self.description}: its fileSize {item.get('fileSize')!r} is not a number")
                continue
            files[item["title"]] = RemoteFile(size, item.get("md5Checksum"), item.get("id"), item.get("modifiedDate"))
        return files

    def _plain_title(self, item: Any, where: str) -> bool:
        """Whether a listed file's title is a plain name; warns once about one that is not (never a path here)."""
        problem = paths.name_problem(item.get("title"))
        if problem is not None:
            paths.warn_once(f"drive:{item.get('id')}", f"skipping {item.get('title')!r} in {where} on "
                                                       f"{self.description}: not a plain file name ({problem})")
        return problem is None

    def put_file(self, folder: str, name: str, source: Path) -> RemoteFile:
        self._check_names(folder, name)
        parent = self._folder_id(self._parts(folder), create=True)

        listed: list[Any] = []

        def find_target() -> Target:
            listed[:] = self._children(parent, name, folders=False)
            chosen = drivelist.newest(listed)
            ours = self._written.get((parent, name))
            if ours is not None and ours not in {item["id"] for item in listed}:
                return Target(folder, name, parent, ours)  # written by us moments ago, not listed yet (lag)
            return Target(folder, name, parent, chosen["id"] if chosen else None)

        what = f"uploading {folder + '/' if folder else ''}{name} to {self.description}"
        try:
            resource = self.uploads.upload(source, folder, name, parent, find_target, what)
        except MissingFile:  # the file it was replacing was deleted meanwhile: upload it as a new file
            self._written.pop((parent, name), None)
            resource = self.uploads.upload(source, folder, name, parent, lambda: Target(folder, name, parent, None),
                                           what)
        if any(key not in resource for key in ("md5Checksum", "fileSize", "modifiedDate")):
            file_id = resource["id"]
            resource = self._call(lambda: self._service().files().get(
                fileId=file_id, fields="id,fileSize,md5Checksum,modifiedDate").execute(http=self.uploads.http()),
                f"checking {name}")
        self._written[(parent, name)] = resource["id"]
        self._drop_older_copies(name, resource, listed)
        return RemoteFile(int(resource["fileSize"]), resource["md5Checksum"], resource["id"],
                          resource.get("modifiedDate"))

    def _drop_older_copies(self, name: str, written: Any, listed: list[Any]) -> None:
        """Delete the same-titled copies older than the file just written: only the writer writes a run folder,
        so they are leftovers (a lost create's twin, a stale copy) that a reader could otherwise pick. A newer
        copy is left alone: it was written after ours, by someone else (a racing lease), and is theirs to keep."""
        for item in listed:
            if item["id"] != written["id"] and drivelist.newest_key(item) < drivelist.newest_key(written):
                try:
                    self._call(lambda i=item: self.drive.CreateFile({"id": i["id"]}).Delete(),
                               f"deleting an older copy of {name}")
                except MissingFile:  # deleted already (a retry whose answer was lost, or by someone else)
                    pass

    def read_by_id(self, file_id: str, target: Path) -> RemoteFile:
        """Download the file ``file_id`` (as returned by put_file) and return its metadata. By id, not by a
        listing: Drive answers a get by id at once, while a listing may not show a new file for a while.
        Raises MissingFile when it was deleted (or trashed)."""
        meta = self._call(lambda: self._service().files().get(
            fileId=file_id, fields="id,fileSize,md5Checksum,modifiedDate,labels").execute(http=self.uploads.http()),
            "reading a file by id")
        if (meta.get("labels") or {}).get("trashed"):
            raise MissingFile(f"the file {file_id} on {self.description} is in the trash")
        self._call(lambda: self.drive.CreateFile({"id": file_id}).GetContentFile(str(target)), "downloading by id")
        return RemoteFile(int(meta.get("fileSize") or 0), meta.get("md5Checksum"), file_id, meta.get("modifiedDate"))

    def get_file(self, folder: str, name: str, target: Path) -> None:
        self._check_names(folder, name)
        parent = self._folder_id(self._parts(folder), create=False)
        found = self._children(parent, name, folders=False) if parent else []
        if not found:
            raise MissingFile(f"{name} is not in {folder or 'the run folder'} on {self.description}")
        file_id = drivelist.newest(found)["id"]  # the copy list_files reports and put_file updates
        self._call(lambda: self.drive.CreateFile({"id": file_id}).GetContentFile(str(target)),
                   f"downloading {name}")

    def _check_names(self, folder: str, name: str) -> None:
        for value in (folder, name) if folder else (name,):
            problem = paths.name_problem(value)
            if problem is not None:
                raise StorageError(f"refusing the name {value!r} on {self.description}: not a plain file name "
                                   f"({problem}); a run folder holds plain names only")

    def delete_file(self, folder: str, name: str) -> None:
        self._check_names(folder, name)
        parent = self._folder_id(self._parts(folder), create=False)
        try:
            found = self._children(parent, name, folders=False) if parent else []
        except MissingFile:  # the folder was deleted since its id was cached
            self._folders.pop(self._parts(folder), None)
            return
        for item in found:  # every file of that title: a duplicate someone made must not survive the delete
            try:  # permanently, like delete_folder: a file in the trash still fills the quota
                self._call(lambda i=item: self.drive.CreateFile({"id": i["id"]}).Delete(), f"deleting {name}")
            except MissingFile:  # a retried delete whose first answer was lost: it is gone, as wanted
                pass

    def delete_folder(self, folder: str) -> None:
        parent = self._folder_id(self._parts(folder), create=False)
        if parent is None:
            return
        try:
            children = self._children(parent, folders=False)
        except MissingFile:  # the folder was deleted since its id was cached
            children = []
        # Manifest first, so a half-deleted folder is never a checkpoint; Delete() skips the trash,
        # so rotating checkpoints never fills the quota. A 404 is success: the delete was retried after its
        # answer was lost (or someone else deleted it), and what was asked for is done.
        for item in sorted(children, key=lambda f: f["title"] != "manifest.json"):
            try:
                self._call(lambda i=item: self.drive.CreateFile({"id": i["id"]}).Delete(), f"deleting {item['title']}")
            except MissingFile:
                pass
        try:
            self._call(lambda: self.drive.CreateFile({"id": parent}).Delete(), f"deleting folder {folder}")
        except MissingFile:
            pass
        self._folders.pop(self._parts(folder), None)
