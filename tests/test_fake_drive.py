"""The real pydrive2 / googleapiclient / httplib2 stack against the loopback Drive v2 fake (tests/fakedrive/).

These pin down both that the fake speaks the protocol pydrive2 uses and how that stack reports each kind of failure,
which is what code uploading checkpoints to Drive has to handle.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pydrive2.files
import pytest
from fakedrive import FOLDER_MIME, FakeDrive, RewritingHttp, make_drive, make_gauth, make_http, make_service
from googleapiclient.errors import HttpError
from googleapiclient.http import MediaIoBaseUpload
from oauth2client.client import AccessTokenCredentialsError
from pydrive2.drive import GoogleDrive
from pydrive2.files import ApiRequestError, GoogleDriveFile

KIB = 1024


@pytest.fixture
def fake() -> Iterator[FakeDrive]:
    with FakeDrive() as server:
        yield server
        assert server.server_errors == [], server.server_errors[0] if server.server_errors else ""


@pytest.fixture
def drive(fake: FakeDrive) -> GoogleDrive:
    return make_drive(fake, timeout=5)


def new_folder(drive: GoogleDrive, title: str = "checkpoints", parent: str = "root") -> GoogleDriveFile:
    folder = drive.CreateFile({"title": title, "mimeType": FOLDER_MIME, "parents": [{"id": parent}]})
    folder.Upload()
    return folder


def new_file(drive: GoogleDrive, data: bytes, title: str = "ckpt.bin", parent: str = "root") -> GoogleDriveFile:
    f = drive.CreateFile({"title": title, "parents": [{"id": parent}]})
    f.content = io.BytesIO(data)  # pydrive2 has SetContentFile/SetContentString only; this is what they do inside
    f.dirty["content"] = True
    f.Upload()
    return f


def titles(drive: GoogleDrive, q: str) -> list[str]:
    return sorted(f["title"] for f in drive.ListFile({"q": q}).GetList())


def http_status(exc: BaseException) -> int:
    """The HTTP status behind an ApiRequestError / HttpError, searching the exception chain."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ApiRequestError):
            return seen.args[0].resp.status
        if isinstance(seen, HttpError):
            return seen.resp.status
        seen = seen.__cause__ or seen.__context__
    raise AssertionError(f"no HTTP error in the chain of {exc!r}")


# --- the happy path -------------------------------------------------------------------------------------------------
def test_static_discovery_and_bearer_token(fake: FakeDrive, drive: GoogleDrive) -> None:
    assert drive.GetAbout()["rootFolderId"] == fake.root_id
    assert fake.requests == [("GET", "/drive/v2/about?alt=json")]  # no discovery-document fetch


def test_wrong_token_is_rejected_without_any_refresh_attempt(fake: FakeDrive) -> None:
    drive = make_drive(fake, token="stale")
    with pytest.raises(AccessTokenCredentialsError):  # oauth2client's reaction to a 401 with a static token
        drive.GetAbout()
    assert fake.requests == [("GET", "/drive/v2/about?alt=json")]


def test_rewriting_http_refuses_real_hosts(fake: FakeDrive) -> None:
    http = RewritingHttp(fake.base_url)
    assert http.rewrite("https://www.googleapis.com/drive/v2/files?q=x") == f"{fake.base_url}/drive/v2/files?q=x"
    assert http.rewrite("https://oauth2.googleapis.com/token") == f"{fake.base_url}/token"
    with pytest.raises(RuntimeError, match="refusing"):
        http.request("https://accounts.google.com/o/oauth2/token")


def test_lifecycle_folder_chunked_upload_list_download(fake: FakeDrive, drive: GoogleDrive, tmp_path: Path) -> None:
    fake.upload_chunk_limit = 256 * KIB  # pydrive2 always sends one 100 MiB chunk; make the server take less
    data = os.urandom(1_000_000)
    folder = new_folder(drive)
    assert folder["parents"][0]["id"] == fake.root_id and folder["mimeType"] == FOLDER_MIME

    uploaded = new_file(drive, data, parent=folder["id"])
    session_puts = [status for method, path, status in fake.responses if method == "PUT" and "upload_id=" in path]
    assert session_puts == [308, 308, 308, 200]  # 1 MB in 256 KiB commits
    assert fake.upload_ranges[1].startswith(f"bytes {256 * KIB}-")  # googleapiclient resumed where the 308 said

    listed = drive.ListFile({"q": f"'{folder['id']}' in parents and trashed=false"}).GetList()
    assert [f["id"] for f in listed] == [uploaded["id"]] == [f.id for f in fake.children(folder["id"])]
    meta = drive.CreateFile({"id": uploaded["id"]})
    meta.FetchMetadata()
    assert meta["md5Checksum"] == hashlib.md5(data).hexdigest()
    assert meta["fileSize"] == str(len(data))

    target = tmp_path / "out.bin"
    meta.GetContentFile(str(target), chunksize=300_000)  # files.get_media with Range headers
    assert target.read_bytes() == data
    assert [s for m, p, s in fake.responses if p.endswith("&alt=media")] == [206] * 4
    # GetContentString goes through metadata['downloadUrl'] with a plain (authorized) GET instead.
    assert drive.CreateFile({"id": uploaded["id"]}).GetContentString(encoding="latin-1").encode("latin-1") == data


def test_client_side_chunk_size(fake: FakeDrive, drive: GoogleDrive, monkeypatch: pytest.MonkeyPatch) -> None:
    # pydrive2 gives no chunk-size knob; patching the class it instantiates is the only client-side way.
    monkeypatch.setattr(pydrive2.files, "MediaIoBaseUpload", functools.partial(MediaIoBaseUpload, chunksize=256 * KIB))
    data = os.urandom(600 * KIB)
    f = new_file(drive, data)
    size, chunk = len(data), 256 * KIB
    assert fake.upload_ranges == [
        f"bytes 0-{chunk - 1}/{size}", f"bytes {chunk}-{2 * chunk - 1}/{size}", f"bytes {2 * chunk}-{size - 1}/{size}"
    ]
    assert fake.files[f["id"]].content == data


def test_overwrite_by_id_keeps_one_file(fake: FakeDrive, drive: GoogleDrive) -> None:
    folder = new_folder(drive)
    first = new_file(drive, b"v1", parent=folder["id"])
    again = drive.CreateFile({"id": first["id"]})
    again.SetContentString("version two")
    again.Upload()
    assert ("POST", f"/upload/drive/v2/files/{first['id']}") not in fake.requests
    assert any(m == "PUT" and p.startswith(f"/upload/drive/v2/files/{first['id']}?") for m, p in fake.requests)
    listed = drive.ListFile({"q": f"'{folder['id']}' in parents"}).GetList()
    assert [(f["id"], f["title"], f["md5Checksum"]) for f in listed] == [
        (first["id"], "ckpt.bin", hashlib.md5(b"version two").hexdigest())
    ]
    assert int(listed[0]["version"]) > int(first["version"])


def test_metadata_patch_renames(drive: GoogleDrive) -> None:
    f = new_file(drive, b"x", title="tmp.part")
    f["title"] = "final.bin"
    f.Upload()  # no content change -> files.patch
    assert titles(drive, "'root' in parents") == ["final.bin"]


def test_trash_versus_delete(fake: FakeDrive, drive: GoogleDrive) -> None:
    folder = new_folder(drive)
    trashed = new_file(drive, b"a", title="trashed.bin", parent=folder["id"])
    deleted = new_file(drive, b"b", title="deleted.bin", parent=folder["id"])
    new_file(drive, b"c", title="kept.bin", parent=folder["id"])
    trashed.Trash()
    deleted.Delete()
    in_folder = f"'{folder['id']}' in parents"
    assert titles(drive, in_folder + " and trashed=false") == ["kept.bin"]
    assert titles(drive, in_folder) == ["kept.bin", "trashed.bin"]  # v2 lists trash unless told not to
    assert titles(drive, in_folder + " and trashed = true") == ["trashed.bin"]
    with pytest.raises(ApiRequestError) as err:
        drive.CreateFile({"id": deleted["id"]}).FetchMetadata()
    assert err.value.error["code"] == 404
    trashed.UnTrash()
    assert titles(drive, in_folder + " and trashed=false") == ["kept.bin", "trashed.bin"]
    folder.Trash()  # contents go to the trash with the folder
    assert titles(drive, in_folder + " and trashed=false") == []
    assert fake.files[trashed["id"]].trashed and not fake.files[trashed["id"]].explicitly_trashed


def test_query_clauses_and_paging(fake: FakeDrive, drive: GoogleDrive) -> None:
    folder = new_folder(drive)
    for name in ("a.bin", "b.bin", "it's.bin", "d.txt", "e.txt"):
        fake.add_file(name, name.encode(), parent=folder["id"])
    new_folder(drive, "sub", parent=folder["id"])
    inside = f"'{folder['id']}' in parents and trashed = false"
    assert titles(drive, inside + " and title = 'it\\'s.bin'") == ["it's.bin"]
    assert titles(drive, inside + f" and mimeType = '{FOLDER_MIME}'") == ["sub"]
    assert titles(drive, inside + f" and mimeType != '{FOLDER_MIME}' and title contains '.txt'") == ["d.txt", "e.txt"]
    pages = [len(page) for page in drive.ListFile({"q": inside, "maxResults": 2})]
    assert pages == [2, 2, 2]
    assert len(drive.ListFile({"q": inside}).GetList()) == 6
    with pytest.raises(ApiRequestError) as err:  # unsupported syntax must not silently match everything
        drive.ListFile({"q": "modifiedDate > '2020-01-01'"}).GetList()
    assert err.value.error["code"] == 400


def test_raw_service_multipart_and_media_uploads(fake: FakeDrive) -> None:
    service = make_service(fake)
    media = MediaIoBaseUpload(io.BytesIO(b"\r\nmultipart\n\r\n"), "application/x-test", resumable=False)
    meta = service.files().insert(body={"title": "m.bin"}, media_body=media).execute()
    assert fake.files[meta["id"]].content == b"\r\nmultipart\n\r\n"
    assert (meta["title"], meta["mimeType"]) == ("m.bin", "application/x-test")
    plain = service.files().insert(media_body=MediaIoBaseUpload(io.BytesIO(b"raw"), "text/plain")).execute()
    assert (plain["title"], fake.files[plain["id"]].content) == ("Untitled", b"raw")
    assert [p.split("uploadType=")[1] for m, p in fake.requests] == ["multipart", "media"]
    renamed = service.files().update(fileId=plain["id"], body={"title": "named.txt"}).execute()  # metadata-only PUT
    assert renamed["title"] == "named.txt" and fake.requests[-1][0] == "PUT"
    assert fake.requests[-1][1].startswith(f"/drive/v2/files/{plain['id']}?")


def test_storage_quota() -> None:
    with FakeDrive(quota_bytes=1000) as small:
        tight = make_drive(small)
        new_file(tight, b"x" * 600)
        with pytest.raises(ApiRequestError) as err:
            new_file(tight, b"y" * 600)
        assert err.value.GetField("reason") == "storageQuotaExceeded"
        assert len(small.files) == 2  # root + the first file


# --- faults ---------------------------------------------------------------------------------------------------------
RETRYABLE = [("userRateLimitExceeded", 403), ("rateLimitExceeded", 403), ("429", 429), ("500", 500), ("503", 503)]


@pytest.mark.parametrize(("fault", "status"), RETRYABLE)
def test_status_fault_on_metadata_call(fake: FakeDrive, drive: GoogleDrive, fault: str, status: int) -> None:
    fake.inject(fault, match="POST /drive/v2/files")
    with pytest.raises(ApiRequestError) as err:  # pydrive2 never retries (num_retries=0)
        new_folder(drive)
    assert err.value.error["code"] == status == http_status(err.value)
    assert fake.faults_fired == [(fault, "POST", "/drive/v2/files?supportsAllDrives=true&alt=json")]
    folder = new_folder(drive)  # the retry works
    assert titles(drive, "trashed=false") == ["checkpoints"] and fake.files[folder["id"]].is_folder


@pytest.mark.parametrize(("fault", "status"), RETRYABLE)
def test_status_fault_mid_upload(fake: FakeDrive, drive: GoogleDrive, fault: str, status: int) -> None:
    fake.upload_chunk_limit = 64 * KIB
    fake.inject(fault, match="upload_id=", skip=1)  # the second chunk fails
    data = os.urandom(200 * KIB)
    f = drive.CreateFile({"title": "ckpt.bin"})
    f.content = io.BytesIO(data)
    f.dirty["content"] = True
    with pytest.raises(ApiRequestError) as err:
        f.Upload()
    assert http_status(err.value) == status
    assert err.value.GetField("reason") == {403: fault, 429: "rateLimitExceeded"}.get(status, "backendError")
    assert len(fake.files) == 1  # nothing but the root: an unfinished session creates no file
    f.Upload()  # same object, fresh session from byte 0
    assert [x.content for x in fake.files.values() if x.title == "ckpt.bin"] == [data]


def test_storage_quota_fault_is_reported_and_not_retried(fake: FakeDrive, drive: GoogleDrive) -> None:
    fake.inject("storageQuotaExceeded", match="POST /upload/")
    with pytest.raises(ApiRequestError) as err:
        new_file(drive, b"data")
    assert err.value.GetField("reason") == "storageQuotaExceeded"
    assert "storage quota" in err.value.GetField("message")
    # googleapiclient itself treats this 403 as final even when asked to retry, unlike the rate-limit ones.
    fake.inject("storageQuotaExceeded")
    fake.inject("userRateLimitExceeded")
    request = make_service(fake).files().list()
    request._sleep = lambda _seconds: None  # skip the real exponential backoff
    with pytest.raises(HttpError) as raw:
        request.execute(num_retries=3)
    assert raw.value.status_code == 403 and raw.value.reason == "The user's Drive storage quota has been exceeded."
    assert request.execute(num_retries=3)["items"] == []  # the rate-limit 403 was retried transparently
    assert [kind for kind, _, _ in fake.faults_fired] == [
        "storageQuotaExceeded", "storageQuotaExceeded", "userRateLimitExceeded"
    ]


@pytest.mark.parametrize("fault", ["html502", "html503"])
def test_html_error_body(fake: FakeDrive, drive: GoogleDrive, fault: str) -> None:
    status = int(fault[-3:])
    fake.inject(fault, match="/drive/v2/files")
    # pydrive2's ApiRequestError json-decodes the body, so an HTML error page escapes as a JSONDecodeError;
    # the HttpError (and its status) is only reachable through the exception chain.
    with pytest.raises(json.JSONDecodeError) as err:
        new_folder(drive)
    assert http_status(err.value) == status
    fake.inject(fault, match="/drive/v2/files")
    with pytest.raises(HttpError) as raw:
        make_service(fake).files().list().execute()
    assert raw.value.status_code == status and b"<html>" in raw.value.content
    assert new_folder(drive)["title"] == "checkpoints"  # the server is fine afterwards


def test_drop_resets_connection(fake: FakeDrive, drive: GoogleDrive) -> None:
    fake.inject("drop", match="POST /drive/v2/files")
    with pytest.raises(ConnectionResetError):  # raw socket error: pydrive2 only wraps HttpError
        new_folder(drive)
    assert len(fake.files) == 1
    new_folder(drive)  # the same Http object reconnects
    assert titles(drive, "'root' in parents") == ["checkpoints"]


def test_drop_mid_upload_then_pydrive2_retry(fake: FakeDrive, drive: GoogleDrive) -> None:
    fake.upload_chunk_limit = 128 * KIB
    fake.inject("drop", match="upload_id=", skip=1)
    data = os.urandom(400 * KIB)
    f = drive.CreateFile({"title": "ckpt.bin"})
    f.content = io.BytesIO(data)
    f.dirty["content"] = True
    with pytest.raises(ConnectionError):  # reset (or broken pipe if the client was still sending)
        f.Upload()
    f.Upload()
    assert [x.content for x in fake.files.values() if x.title == "ckpt.bin"] == [data]


def test_drop_mid_upload_raw_client_resumes_the_session(fake: FakeDrive) -> None:
    data = os.urandom(600 * KIB)
    media = MediaIoBaseUpload(io.BytesIO(data), "application/octet-stream", chunksize=256 * KIB, resumable=True)
    request = make_service(fake).files().insert(body={"title": "ckpt.bin"}, media_body=media)
    fake.inject("drop", match="upload_id=", skip=1)
    status, body = request.next_chunk()
    assert body is None and status.resumable_progress == 256 * KIB
    with pytest.raises(ConnectionError):
        request.next_chunk()  # the server kept the first half of the dropped chunk
    while body is None:
        status, body = request.next_chunk()
    assert fake.upload_ranges[2:4] == [f"bytes */{len(data)}", f"bytes {384 * KIB}-{len(data) - 1}/{len(data)}"]
    assert body["md5Checksum"] == hashlib.md5(data).hexdigest()


def test_clean_close_is_retried_once_by_httplib2(fake: FakeDrive, drive: GoogleDrive) -> None:
    fake.inject("close", match="POST /drive/v2/files")
    new_folder(drive)  # httplib2 silently re-sends (even a POST) after a closed keep-alive connection
    assert [m for m, p in fake.requests] == ["POST", "POST"] and len(fake.faults_fired) == 1
    fake.inject("close", count=2, match="POST /drive/v2/files")
    with pytest.raises(ConnectionError):  # http.client.RemoteDisconnected on the second close
        new_folder(drive, "second")
    assert titles(drive, "'root' in parents") == ["checkpoints"]


def test_clean_close_mid_upload_hangs_until_timeout(fake: FakeDrive) -> None:
    # httplib2's silent retry re-sends the chunk headers but not the already-consumed body stream, so the
    # request never completes: without an Http timeout (pydrive2's default is None) this would hang forever.
    drive = make_drive(fake, timeout=1.0)
    fake.upload_chunk_limit = 64 * KIB
    fake.inject("close", match="upload_id=", skip=1)
    with pytest.raises(TimeoutError):
        new_file(drive, os.urandom(200 * KIB))
    assert [m for m, p in fake.requests].count("PUT") == 3
    new_file(drive, b"small")  # the same Http recovers
    assert titles(drive, "trashed=false") == ["ckpt.bin"]


def test_stall_times_out_but_the_change_lands(fake: FakeDrive) -> None:
    drive = make_drive(fake, timeout=0.5)
    fake.inject("stall", match="POST /drive/v2/files", seconds=2.0)
    with pytest.raises(TimeoutError):  # socket.timeout, unwrapped
        new_folder(drive)
    # The server applied the request before stalling: a blind retry would create a duplicate.
    assert titles(drive, "'root' in parents") == ["checkpoints"]
    new_folder(drive, "second")
    assert titles(drive, "'root' in parents") == ["checkpoints", "second"]


def test_fault_matching_count_and_skip(fake: FakeDrive) -> None:
    service = make_service(fake)
    fake.inject("500", count=2, match="GET /drive/v2/about", skip=1)
    assert service.about().get().execute()["kind"] == "drive#about"  # skipped
    assert service.files().list().execute()["items"] == []  # not matched
    for _ in range(2):
        with pytest.raises(HttpError) as err:
            service.about().get().execute()
        assert err.value.status_code == 500
    assert service.about().get().execute()["kind"] == "drive#about"  # count exhausted
    assert len(fake.faults_fired) == 2 and len(fake.requests) == 5
    with pytest.raises(ValueError, match="unknown fault"):
        fake.inject("404")


def test_make_gauth_gives_every_thread_a_rewriting_http(fake: FakeDrive) -> None:
    gauth = make_gauth(fake, timeout=2)
    assert gauth.Get_Http_Object().request.credentials.access_token == "fake-token"
    assert isinstance(gauth._build_http(), RewritingHttp) and gauth._build_http().timeout == 2
    resp, content = make_http(fake).request("https://www.googleapis.com/drive/v2/about")
    assert resp.status == 200 and json.loads(content)["rootFolderId"] == fake.root_id


def test_concurrent_uploads_from_threads(fake: FakeDrive, drive: GoogleDrive) -> None:
    # pydrive2 gives each thread its own Http (via GoogleAuth._build_http), so this exercises the per-thread path.
    fake.upload_chunk_limit = 64 * KIB
    blobs = {f"part{i}.bin": os.urandom(200 * KIB + i) for i in range(4)}
    with ThreadPoolExecutor(max_workers=4) as pool:
        files = list(pool.map(lambda item: new_file(drive, item[1], title=item[0]), blobs.items()))
    assert {f["title"]: fake.files[f["id"]].content for f in files} == blobs
    assert len({f["id"] for f in files}) == 4


def test_stop_cuts_keep_alive_connections() -> None:
    fake = FakeDrive().start()
    drive = make_drive(fake)
    assert drive.GetAbout()["kind"] == "drive#about"
    fake.stop()
    with pytest.raises(ConnectionError):  # not answered by a lingering handler thread
        drive.GetAbout()


def test_api_behaviour_knobs_short_pages_lag_lost_answers_corrupt_downloads(fake: FakeDrive, drive: GoogleDrive,
                                                                           tmp_path: Path) -> None:
    """The documented Drive behaviours the client must survive (issue #15), each switched on by a knob."""
    folder = new_folder(drive, "run")
    for i in range(5):
        new_file(drive, b"x" * i, f"f{i}", folder["id"])
    fake.max_page = 2  # short pages: one call sees 2 of 5, the rest behind nextPageToken
    page = drive.auth.service.files().list(q=f"'{folder['id']}' in parents", maxResults=1000).execute()
    assert len(page["items"]) == 2 and "nextPageToken" in page
    # pydrive2's GetList() stops after one page when maxResults is given; iterating follows every token.
    assert len(drive.ListFile({"q": f"'{folder['id']}' in parents", "maxResults": 1000}).GetList()) == 2
    assert sum(len(p) for p in drive.ListFile({"q": f"'{folder['id']}' in parents", "maxResults": 1000})) == 5
    fake.max_page = None
    fake.add_file("f0", b"dup", folder["id"], modified="2099-01-01T00:00:00.000Z")  # a same-titled duplicate
    assert titles(drive, f"'{folder['id']}' in parents and title='f0'") == ["f0", "f0"]
    fake.list_lag_s = 60.0  # a listing does not see a file created just now; a get by id does
    young = new_file(drive, b"young", "young", folder["id"])
    assert "young" not in titles(drive, f"'{folder['id']}' in parents")
    assert drive.CreateFile({"id": young["id"]}).GetContentString() == "young"
    fake.list_lag_s = 0.0
    fake.inject("lost", match="DELETE")  # the delete is applied, its answer lost
    with pytest.raises(ConnectionResetError):  # the answer never comes: the client sees a reset
        drive.CreateFile({"id": young["id"]}).Delete()
    assert young["id"] not in fake.files
    fake.corrupt_first_download = True
    got, f4 = tmp_path / "f4", next(f.id for f in fake.children(folder["id"]) if f.title == "f4")
    drive.CreateFile({"id": f4}).GetContentFile(str(got))
    assert got.read_bytes() != b"xxxx" and len(got.read_bytes()) == 4  # one byte flipped, same length
    drive.CreateFile({"id": f4}).GetContentFile(str(got))
    assert got.read_bytes() == b"xxxx"  # the second download is intact
