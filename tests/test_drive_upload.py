"""Uploads that survive the connection and the VM: Drive's resumable protocol (storage/upload.py) against the
loopback Drive server, counting the bytes the server received per upload session."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakedrive import FakeDrive, make_drive

from resumable.storage import StorageError, TransientStorageError, drive_chunk_size, open_run_location
from resumable.storage.gdrive import DriveLocation, GDriveStore
from resumable.storage.retry import RetryPolicy
from resumable.storage.upload import SESSION_SUFFIX, check_chunk_size

CHUNK = 256 * 1024
SIZE = 16 * CHUNK + 12345  # 16 full chunks and a short last one
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def fake():
    with FakeDrive() as server:
        yield server
        assert not server.server_errors, server.server_errors


def store(fake: FakeDrive | str, sessions: Path | None, attempts: int = 6) -> GDriveStore:
    return GDriveStore(make_drive(fake), DriveLocation.parse("gdrive://root/runs/up"),
                       RetryPolicy(attempts=attempts, base_s=0.01), sessions_dir=sessions, chunk_size=CHUNK)


def payload(path: Path, size: int = SIZE, seed: bytes = b"a") -> Path:
    block = hashlib.sha256(seed).digest() * (size // 32 + 1)
    path.write_bytes(bytes(b ^ (i % 251) for i, b in enumerate(block[:size])))
    return path


def on_drive(fake: FakeDrive, title: str) -> list:
    with fake.lock:
        return [f for f in fake.files.values() if f.title == title and not f.trashed]


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def records(sessions: Path) -> list[Path]:
    return sorted(sessions.glob(f"*{SESSION_SUFFIX}")) if sessions.is_dir() else []


@pytest.mark.parametrize("fault", ["cut", "drop", "503", "429", "html502"])
def test_a_fault_half_way_resends_at_most_one_chunk(fake: FakeDrive, tmp_path: Path, fault: str) -> None:
    source = payload(tmp_path / "state.pt")
    if fault == "cut":  # the connection is reset once the session has 50% of the file; the cut chunk is lost
        fake.cut_upload(SIZE // 2 + 1000)
    else:  # the 9th chunk's PUT fails (drop: half its body arrives, then a reset)
        fake.inject(fault, match="upload_id=", skip=8)
    got = store(fake, tmp_path / "sessions").put_file("step-000000001", "state.pt", source)
    assert fake.faults_fired, "the fault hit the upload"
    assert (got.size, got.md5) == (SIZE, md5(source))
    assert len(fake.upload_bytes) == 1, "one session from start to end, not a new upload"
    resent = fake.received_upload_bytes() - SIZE
    assert 0 <= resent <= CHUNK, f"re-sent {resent} bytes, more than one chunk ({CHUNK})"
    assert any(r == f"bytes */{SIZE}" for r in fake.upload_ranges), "the client asked Drive what it holds"
    (remote,) = on_drive(fake, "state.pt")
    assert remote.md5 == md5(source)
    assert records(tmp_path / "sessions") == [], "the session record goes once the upload is complete"


CHILD = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from fakedrive import make_drive
from resumable.storage.gdrive import DriveLocation, GDriveStore
from resumable.storage.retry import RetryPolicy
store = GDriveStore(make_drive({url!r}), DriveLocation.parse("gdrive://root/runs/up"),
                    RetryPolicy(attempts=3, base_s=0.01), sessions_dir=Path({sessions!r}), chunk_size={chunk})
got = store.put_file("step-000000001", "state.pt", Path({source!r}))
print(got.size, got.md5, store.uploads.resumed_from)
"""


def _child(fake: FakeDrive, sessions: Path, source: Path) -> subprocess.Popen:
    code = CHILD.format(tests=str(TESTS), url=fake.base_url, sessions=str(sessions), chunk=CHUNK, source=str(source))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_sigkill_mid_upload_the_next_process_continues_from_what_drive_holds(fake: FakeDrive, tmp_path: Path) -> None:
    source = payload(tmp_path / "state.pt")
    sessions = tmp_path / "sessions"
    fake.bandwidth = 1_000_000  # ~4.2 s for the file: the kill lands mid-upload
    first = _child(fake, sessions, source)
    deadline = time.monotonic() + 60
    while fake.received_upload_bytes() < SIZE // 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    _, stderr = first.communicate()
    assert first.returncode == -signal.SIGKILL, stderr
    before = fake.received_upload_bytes()
    assert SIZE // 2 <= before < SIZE, f"killed mid-upload ({before} of {SIZE} bytes)\n{stderr}"
    assert len(records(sessions)) == 1, "the session was kept in the local cache"
    assert on_drive(fake, "state.pt") == []
    fake.bandwidth = None
    second = _child(fake, sessions, source)
    out, stderr = second.communicate(timeout=60)
    assert second.returncode == 0, stderr
    size, digest, resumed_from = out.split()
    assert (int(size), digest) == (SIZE, md5(source))
    assert int(resumed_from) >= SIZE // 2 - CHUNK, "continued from Drive's acknowledged offset"
    assert len(fake.upload_bytes) == 1, "the same session, not a new one"
    resent = fake.received_upload_bytes() - SIZE
    assert 0 <= resent <= CHUNK, f"re-sent {resent} bytes, more than one chunk"
    (remote,) = on_drive(fake, "state.pt")
    assert remote.md5 == md5(source)
    assert records(sessions) == []


def _abandoned_upload(fake: FakeDrive, sessions: Path, source: Path) -> None:
    """A process whose upload failed for good after 9 chunks, leaving its session record behind."""
    fake.inject("503", count=100, match="upload_id=", skip=8)
    with pytest.raises(TransientStorageError):
        store(fake, sessions, attempts=2).put_file("step-000000001", "state.pt", source)
    fake.clear_faults()
    assert len(records(sessions)) == 1 and len(fake.upload_bytes) == 1


def _started_over(fake: FakeDrive, sessions: Path, source: Path) -> int:
    """Upload ``source`` again; the bytes the new session received (the old session is left alone)."""
    first = next(iter(fake.upload_bytes))
    got = store(fake, sessions).put_file("step-000000001", "state.pt", source)
    assert (got.size, got.md5) == (source.stat().st_size, md5(source))
    (new,) = set(fake.upload_bytes) - {first}
    assert fake.upload_bytes[new] == source.stat().st_size, "a new session, from byte 0, sent once"
    (remote,) = on_drive(fake, "state.pt")
    assert remote.md5 == md5(source)
    assert records(sessions) == []
    return fake.upload_bytes[new]


@pytest.mark.parametrize("status", [404, 410])
def test_an_expired_session_starts_over_from_zero(fake: FakeDrive, tmp_path: Path, status: int) -> None:
    source, sessions = payload(tmp_path / "state.pt"), tmp_path / "sessions"
    _abandoned_upload(fake, sessions, source)
    fake.expire_upload_sessions(status)
    assert _started_over(fake, sessions, source) == source.stat().st_size  # from byte 0, sent once


def test_a_fresh_cache_starts_over_from_zero(fake: FakeDrive, tmp_path: Path) -> None:
    source, sessions = payload(tmp_path / "state.pt"), tmp_path / "sessions"
    _abandoned_upload(fake, sessions, source)
    assert _started_over(fake, tmp_path / "fresh-vm-sessions", source) == source.stat().st_size  # from byte 0


def test_a_changed_local_file_starts_over_from_zero(fake: FakeDrive, tmp_path: Path) -> None:
    source, sessions = payload(tmp_path / "state.pt"), tmp_path / "sessions"
    _abandoned_upload(fake, sessions, source)
    payload(tmp_path / "other", seed=b"b").replace(source)  # same name and size, other bytes
    assert _started_over(fake, sessions, source) == source.stat().st_size  # from byte 0, sent once


def test_a_kept_session_of_a_completed_upload_is_not_uploaded_again(fake: FakeDrive, tmp_path: Path) -> None:
    """Killed after Drive completed the file but before the record was removed: the status query answers 200."""
    source, sessions = payload(tmp_path / "state.pt"), tmp_path / "sessions"
    _abandoned_upload(fake, sessions, source)
    (record,) = records(sessions)
    kept = record.read_bytes()
    store(fake, sessions).put_file("step-000000001", "state.pt", source)  # continues and completes the session
    received = fake.received_upload_bytes()
    record.write_bytes(kept)
    got = store(fake, sessions).put_file("step-000000001", "state.pt", source)
    assert got.md5 == md5(source) and len(on_drive(fake, "state.pt")) == 1
    assert fake.received_upload_bytes() == received, "nothing sent again"
    assert records(sessions) == []


def test_a_broken_session_record_is_ignored_with_a_warning(fake: FakeDrive, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    source, sessions = payload(tmp_path / "state.pt"), tmp_path / "sessions"
    _abandoned_upload(fake, sessions, source)
    records(sessions)[0].write_text('{"uri": 7}')
    _started_over(fake, sessions, source)
    assert "ignoring the upload session record" in caplog.text


def test_a_session_record_pointing_at_another_host_is_never_contacted(fake: FakeDrive, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A planted record must not make resumable send the file (and its token) anywhere but Drive's upload host."""
    source, sessions = payload(tmp_path / "state.pt"), tmp_path / "sessions"
    _abandoned_upload(fake, sessions, source)
    (record,) = records(sessions)
    data = json.loads(record.read_text())
    assert data["uri"].startswith("https://www.googleapis.com/upload/drive/v2/files"), data["uri"]
    data["uri"] = data["uri"].replace("https://www.googleapis.com", "https://attacker.example")
    record.write_text(json.dumps(data))
    # make_drive's Http raises on any non-Google, non-loopback host, so contacting it would fail the upload.
    _started_over(fake, sessions, source)
    assert "its URI is not on www.googleapis.com" in caplog.text


def test_chunk_size_must_be_a_multiple_of_256_kib(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_chunk_size(CHUNK) == CHUNK
    for bad in (0, -CHUNK, 1000, CHUNK + 1):
        with pytest.raises(ValueError, match="multiple of 256 KiB"):
            check_chunk_size(bad)
    monkeypatch.setenv("RESUMABLE_DRIVE_CHUNK_MIB", "0.3")
    with pytest.raises(ValueError, match="RESUMABLE_DRIVE_CHUNK_MIB='0.3'.*multiple of 0.25"):
        drive_chunk_size()
    monkeypatch.setenv("RESUMABLE_DRIVE_CHUNK_MIB", "2.5")
    assert drive_chunk_size() == 10 * CHUNK


def test_sessions_live_in_the_cache_beside_the_checkpoints(fake: FakeDrive, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESUMABLE_DRIVE_ENDPOINT", fake.base_url)
    monkeypatch.setenv("RESUMABLE_DRIVE_TOKEN", "fake-token")
    location = open_run_location("gdrive://root/runs/x", str(tmp_path / "cache"))
    assert location.remote.uploads.records.directory == location.local_dir / ".upload-sessions"
    assert location.remote.uploads.chunk_size == 8 * 1024 * 1024


def test_quota_exceeded_mid_session_is_reported_not_retried(fake: FakeDrive, tmp_path: Path) -> None:
    source = payload(tmp_path / "state.pt")
    fake.inject("storageQuotaExceeded", match="upload_id=", skip=3)
    with pytest.raises(StorageError, match="storageQuotaExceeded") as raised:
        store(fake, tmp_path / "sessions").put_file("step-000000001", "state.pt", source)
    assert not isinstance(raised.value, TransientStorageError)
