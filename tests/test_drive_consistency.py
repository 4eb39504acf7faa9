"""The Drive API as it really behaves, on the loopback Drive: short pages, same-titled duplicates, listing lag,
lost answers, verifying a gdrive:// run dir, and the first retry's wait. Each test switches on the documented
Drive behaviour it survives (tests/fakedrive/api.py: max_page, list_lag_s, the "lost" fault, generateIds)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from fakedrive import FakeDrive, make_drive

from resumable.checkpoint import CheckpointManager, checkpoints_dir, fingerprint
from resumable.checkpoint import format as fmt
from resumable.checkpoint import manifest as manifests
from resumable.checkpoint.layout import STEPS
from resumable.cli import main
from resumable.errors import RunDirInUse
from resumable.storage.durable import remote_manifest
from resumable.storage.gdrive import DriveLocation, GDriveStore
from resumable.storage.lease import LEASE, DriveLease
from resumable.storage.retry import RetryPolicy, TransientStorageError
from resumable.storage.tiered import Mirror, durable_steps, restore_newest

OLD, NEW = "2000-01-01T00:00:00.000Z", "2099-01-01T00:00:00.000Z"


@pytest.fixture
def fake():
    with FakeDrive() as server:
        yield server
        assert not server.server_errors, server.server_errors


def store(fake: FakeDrive, path: str = "runs/t", chunk: int | None = None) -> GDriveStore:
    extra = {"chunk_size": chunk} if chunk else {}
    return GDriveStore(make_drive(fake), DriveLocation.parse(f"gdrive://root/{path}"),
                       RetryPolicy(attempts=6, base_s=0.01), **extra)


def named(fake: FakeDrive, title: str) -> list:
    with fake.lock:
        return [f for f in fake.files.values() if f.title == title and not f.trashed]


def folder_of(fake: FakeDrive, *parts: str) -> str:
    """The id of ``root/parts...`` as the store created it (exactly one folder of each name must exist)."""
    parent = fake.root_id
    for part in parts:
        found = [f for f in fake.children(parent) if f.title == part and f.is_folder]
        assert len(found) == 1, (part, found)
        parent = found[0].id
    return parent


def mirrored_run(fake: FakeDrive, root: Path, steps: list[int], path: str = "runs/t") -> CheckpointManager:
    import torch

    manager = CheckpointManager(checkpoints_dir(root))
    for step in steps:
        model = {"w": torch.full((64, 64), float(step))}
        manager.save(step, {"model": model, "optimizer": {}}, {"fingerprint": fingerprint(model, {})})
    (root / "metrics.jsonl").write_text('{"step": 1}\n')
    mirror = Mirror(manager, store(fake, path), root, lambda line: None)
    for step in steps:
        mirror.submit(step)
    assert mirror.flush(30) == [] and not mirror.errors, mirror.errors
    assert mirror.close(30)
    return manager


# -- 1: every page of a listing ---------------------------------------------------------------------------
def test_listings_follow_every_page(fake: FakeDrive, tmp_path: Path) -> None:
    manager = mirrored_run(fake, tmp_path / "run", [1, 2, 3])
    step_files = set(manifests.read(manager.root / "step-000000003").body["files"]) | {fmt.MANIFEST}
    s = store(fake)
    (tmp_path / "s.jsonl").write_text('{"session": 1}\n')
    s.put_file("", "sessions.jsonl", tmp_path / "s.jsonl")
    s.put_file("", "notes.txt", tmp_path / "s.jsonl")
    fake.max_page = 2  # Drive may return fewer items than maxResults; the rest sit behind nextPageToken
    fresh = store(fake)
    assert fresh.list_checkpoints() == ["step-000000001", "step-000000002", "step-000000003"]
    assert set(fresh.list_files("step-000000003")) == step_files and len(step_files) > 2
    assert {"sessions.jsonl", "metrics.jsonl", "notes.txt"} <= set(fresh.list_files(""))
    assert durable_steps(fresh, tmp_path) == [1, 2, 3]
    back = CheckpointManager(checkpoints_dir(tmp_path / "back"))
    assert restore_newest(fresh, back, tmp_path / "back", lambda line: None) == 3
    assert back.latest_valid()[0].step == 3


# -- 2: same-titled duplicates ----------------------------------------------------------------------------
@pytest.mark.parametrize("planted", [OLD, NEW])
def test_a_duplicate_metrics_log_is_never_read_stale(fake: FakeDrive, tmp_path: Path, planted: str) -> None:
    s = store(fake)
    source = tmp_path / "metrics.jsonl"
    source.write_text('{"step": 1}\n')
    s.put_file("", "metrics.jsonl", source)
    run = folder_of(fake, "runs", "t")
    fake.add_file("metrics.jsonl", b'{"step": "a stale duplicate"}\n', run, modified=planted)
    newest = b'{"step": "a stale duplicate"}\n' if planted == NEW else b'{"step": 1}\n'
    s.get_file("", "metrics.jsonl", tmp_path / "read")
    assert (tmp_path / "read").read_bytes() == newest  # readers take the newest copy
    assert s.list_files("")["metrics.jsonl"].size == len(newest)  # and the listing agrees with the read
    source.write_text('{"step": 1}\n{"step": 2}\n')
    s.put_file("", "metrics.jsonl", source)  # the writer updates that copy and deletes the other one
    assert len(named(fake, "metrics.jsonl")) == 1
    s.get_file("", "metrics.jsonl", tmp_path / "read")
    assert (tmp_path / "read").read_bytes() == source.read_bytes()


@pytest.mark.parametrize("planted", [OLD, NEW])
def test_a_duplicate_lease_never_locks_the_run_dir_for_good(fake: FakeDrive, planted: str) -> None:
    s = store(fake)
    first = DriveLease(s, settle_s=0)
    assert first.acquire() is None
    first.release()
    gone = {"pid": 1, "host": "another-vm", "token": "x", "started": "earlier", "heartbeat": time.time() - 3600}
    fake.add_file(LEASE, json.dumps(gone).encode(), folder_of(fake, "runs", "t"), modified=planted)
    for _ in range(2):  # and again: the run dir stays usable, not only once
        lease = DriveLease(store(fake), settle_s=0)
        lease.acquire()
        assert lease.lost is None
        lease.release()
    assert len(named(fake, LEASE)) == 1


def test_duplicate_folders_resolve_to_the_oldest_whatever_the_listing_order(fake: FakeDrive, tmp_path: Path) -> None:
    mirrored_run(fake, tmp_path / "run", [1])
    runs = folder_of(fake, "runs")
    late = fake.add_file("t", b"", runs, mime_type="application/vnd.google-apps.folder")
    late.created = NEW  # an empty duplicate of the run folder, made later (a racing create, a copy in the web UI)
    with fake.lock:  # Drive's listing order is unspecified: list the late duplicate first
        fake.files = {late.id: late, **{k: v for k, v in fake.files.items() if k != late.id}}
    assert durable_steps(store(fake), tmp_path) == [1]  # the run stays where it was created


# -- 3: a lagging listing ---------------------------------------------------------------------------------
def test_a_lease_on_an_empty_folder_is_taken_when_the_listing_lags(fake: FakeDrive) -> None:
    fake.list_lag_s = 30.0  # far longer than the settle: the lease just written is not listed yet
    lease = DriveLease(store(fake), settle_s=0.05)
    assert lease.acquire() is None
    assert len(named(fake, LEASE)) == 1
    lease.release()
    released = json.loads(named(fake, LEASE)[0].content)
    assert released["released"] is True and len(named(fake, LEASE)) == 1  # updated by id, not duplicated


def test_a_live_lease_of_another_machine_that_is_listed_still_refuses(fake: FakeDrive, tmp_path: Path) -> None:
    s = store(fake)
    (tmp_path / "notes.txt").write_text("a run folder\n")
    s.put_file("", "notes.txt", tmp_path / "notes.txt")
    fake.list_lag_s = 30.0
    live = {"pid": 7, "host": "another-vm", "token": "x", "started": "now", "heartbeat": time.time()}
    seen = fake.add_file(LEASE, json.dumps(live).encode(), folder_of(fake, "runs", "t"))
    seen.born -= 60  # written a minute ago: listed
    with pytest.raises(RunDirInUse, match="another-vm"):
        DriveLease(s, settle_s=0.05).acquire()


# -- 4: lost answers --------------------------------------------------------------------------------------
def test_deletes_whose_answers_were_lost_count_as_done(fake: FakeDrive, tmp_path: Path) -> None:
    s = store(fake)
    source = tmp_path / "f"
    source.write_bytes(b"x" * 100)
    for name in ("a", "b", fmt.MANIFEST):
        s.put_file("step-000000001", name, source)
    step = folder_of(fake, "runs", "t", "checkpoints", "step-000000001")
    fake.inject("lost", match="DELETE")  # a file's delete is applied, its answer lost: the retry gets 404
    fake.inject("lost", match=f"DELETE /drive/v2/files/{step}")  # and the folder's own delete
    s.delete_folder("step-000000001")
    assert [kind for kind, _, _ in fake.faults_fired] == ["lost", "lost"]
    assert s.list_checkpoints() == [] and step not in fake.files


def test_a_folder_create_whose_answer_was_lost_leaves_one_folder(fake: FakeDrive, tmp_path: Path) -> None:
    fake.list_lag_s = 30.0  # the retry cannot find the folder by listing
    fake.inject("lost", match="POST /drive/v2/files?", count=2)  # "runs" and "t" are created, answers lost
    source = tmp_path / "f"
    source.write_bytes(b"x" * 100)
    store(fake).put_file("step-000000001", "a", source)
    assert [kind for kind, _, _ in fake.faults_fired] == ["lost", "lost"]
    for title in ("runs", "t", "checkpoints", "step-000000001", "a"):
        assert len(named(fake, title)) == 1, title


@pytest.mark.parametrize("where", ["POST /upload/", "upload_id="])
def test_an_upload_whose_last_answer_was_lost_makes_one_file(fake: FakeDrive, tmp_path: Path, where: str) -> None:
    chunk = 256 * 1024
    source = tmp_path / "state.pt"
    source.write_bytes(bytes(range(256)) * 2600)  # 3 chunks
    s = store(fake, chunk=chunk)
    s.list_checkpoints()
    fake.inject("lost", match=where, skip=2 if where == "upload_id=" else 0)  # the session start or last chunk
    got = s.put_file("step-000000001", "state.pt", source)
    assert [kind for kind, _, _ in fake.faults_fired] == ["lost"]
    files = named(fake, "state.pt")
    assert len(files) == 1 and files[0].content == source.read_bytes()
    assert got.md5 == hashlib.md5(source.read_bytes()).hexdigest()


# -- 5: verify and inspect a gdrive:// run dir ------------------------------------------------------------
def _drive_cli(fake: FakeDrive, monkeypatch: pytest.MonkeyPatch, *args: str):  # noqa: ANN202 - click's Result
    for key, value in {"RESUMABLE_DRIVE_ENDPOINT": fake.base_url, "RESUMABLE_DRIVE_TOKEN": "fake-token",
                       "RESUMABLE_RETRY_BASE_S": "0.01", "RESUMABLE_DRIVE_TIMEOUT": "5"}.items():
        monkeypatch.setenv(key, value)
    return CliRunner().invoke(main, list(args))


def _without_md5(fake: FakeDrive, manager: CheckpointManager, step: int) -> None:
    """Upload step's local manifest over the mirror's, which records Drive's md5 of each file: the remote manifest
    as earlier versions wrote it (sizes and sha256 only)."""
    folder = STEPS.name(step)
    assert any("md5" in e for e in remote_manifest(store(fake), folder, manager.root)["files"].values())
    store(fake).put_file(folder, fmt.MANIFEST, manager.root / folder / fmt.MANIFEST)


def _corrupt(fake: FakeDrive, manager: CheckpointManager, step: int) -> str:
    """Flip one byte of step's largest payload file on Drive (same size: a size check cannot see it)."""
    files = manifests.read(manager.root / STEPS.name(step)).body["files"]
    name = max(files, key=lambda n: files[n]["size"])
    with fake.lock:
        f = next(f for f in fake.files.values() if f.title == name
                 and fake.files[f.parents[0]].title == STEPS.name(step))
        f.content = bytes([f.content[0] ^ 0xFF]) + f.content[1:]
    return name


def test_verify_checks_a_drive_run_dir_without_downloading(fake: FakeDrive, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    manager = mirrored_run(fake, tmp_path / "run", [1, 2])
    _without_md5(fake, manager, 1)
    result = _drive_cli(fake, monkeypatch, "verify", "gdrive://root/runs/t")
    assert result.exit_code == 0, result.output
    assert "step 1: ok (sizes checked" in result.output and "step 2: ok (sizes and md5 checked)" in result.output
    with fake.lock:
        manifests = {f.id for f in fake.files.values() if f.title == fmt.MANIFEST}
        downloaded = {path.split("/")[4].split("?")[0] for _, path in fake.requests if "alt=media" in path}
    assert downloaded <= manifests, "a download-free verify reads the manifests only"
    name = _corrupt(fake, manager, 2)
    result = _drive_cli(fake, monkeypatch, "verify", "gdrive://root/runs/t")
    assert result.exit_code == 1 and f"step 2: INVALID: {name}" in result.output and "md5" in result.output
    assert "resumes from step 1" in result.output


def test_verify_deep_hashes_what_drive_holds(fake: FakeDrive, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    manager = mirrored_run(fake, tmp_path / "run", [1])
    _without_md5(fake, manager, 1)
    name = _corrupt(fake, manager, 1)
    shallow = _drive_cli(fake, monkeypatch, "verify", "gdrive://root/runs/t")
    assert shallow.exit_code == 0 and "sizes checked" in shallow.output  # no md5 recorded: a size check passes
    deep = _drive_cli(fake, monkeypatch, "verify", "--deep", "gdrive://root/runs/t")
    assert deep.exit_code == 1 and f"{name} does not match its sha256" in deep.output, deep.output


def test_inspect_says_what_was_checked_and_deep_hashes(fake: FakeDrive, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    manager = mirrored_run(fake, tmp_path / "run", [1, 2])
    _without_md5(fake, manager, 1)
    text = _drive_cli(fake, monkeypatch, "inspect", "gdrive://root/runs/t").output
    assert "durable on Drive (sizes and md5 checked)" in text, text
    data = json.loads(_drive_cli(fake, monkeypatch, "inspect", "--json", "gdrive://root/runs/t").output)
    assert [c["checked"] for c in data["checkpoints"]] == ["sizes", "sizes and md5"]
    name = _corrupt(fake, manager, 1)
    deep = _drive_cli(fake, monkeypatch, "inspect", "--deep", "gdrive://root/runs/t")
    assert deep.exit_code == 0, deep.output
    assert f"INVALID: {name} does not match its sha256" in deep.output
    assert "durable on Drive (sizes and sha256 checked)" in deep.output and "<- latest valid" in deep.output


# -- 6: the first retry waits ------------------------------------------------------------------------------
def test_the_first_retry_waits_at_least_the_base_and_backoff_doubles() -> None:
    waits: list[float] = []
    policy = RetryPolicy(attempts=8, sleep=waits.append)  # the defaults: base 1 s, at most 64 s
    failures = iter(range(7))

    def flaky() -> str:
        if next(failures, None) is not None:
            raise OSError("reset")
        return "ok"

    assert policy.call(flaky, lambda e: TransientStorageError(str(e)), "a test call") == "ok"
    assert len(waits) == 7
    assert 1.0 <= waits[0] <= 2.0  # Google: wait 1 s + jitter before the first retry, never at once
    for k, wait in enumerate(waits):
        ceiling = min(64.0, 2.0 ** (k + 1))
        assert ceiling / 2 <= wait <= ceiling, (k, wait)
    fast = RetryPolicy(base_s=0.01)  # RESUMABLE_RETRY_BASE_S=0.01 in tests: the floor scales with it
    assert all(0.01 <= fast.delay(0) <= 0.02 for _ in range(100))
