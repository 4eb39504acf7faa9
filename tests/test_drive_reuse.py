"""The Drive tier stores a file shared by consecutive checkpoints once (issue #11, big states).

Locally the writer hard-links a shard whose bytes equal the previous checkpoint's; on the remote the Mirror does
not upload it again: the newer checkpoint's remote manifest places it in the older folder (storage/placement.py),
restores read it from there, and retention keeps a pruned folder's files that newer checkpoints still use (a
"holder"). Every test runs on a mounted folder (a tmp dir) and on the loopback Drive v2 fake (tests/fakedrive/).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakedrive import FakeDrive, make_drive

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.checkpoint import format as fmt
from resumable.checkpoint.layout import STEPS
from resumable.checkpoint.manifest import parse, read, seal
from resumable.storage.base import RemoteFile
from resumable.storage.gdrive import DriveLocation, GDriveStore
from resumable.storage.mounted import MountedDirStore
from resumable.storage.placement import HOLDER, MIN_REUSE_BYTES
from resumable.storage.retry import RetryPolicy
from resumable.storage.tiered import Mirror, describe_remote, durable_steps, restore_newest

RUN = "run-reuse"
SHARD0, SHARD1, META = "shard-00000.safetensors", "shard-00001.safetensors", "meta.pt"
BIG = MIN_REUSE_BYTES + 4096  # a shard worth reusing; smaller files are uploaded again


def folder(step: int) -> str:
    return STEPS.name(step)


class Recording:
    """A RemoteStore that records every upload and deletion of the store it wraps."""

    def __init__(self, inner, fake: FakeDrive | None = None) -> None:  # noqa: ANN001 - any RemoteStore
        self.inner = inner
        self.fake = fake  # the Drive fake behind a GDriveStore, None for a mounted folder
        self.puts: list[tuple[str, str]] = []
        self.deletes: list[tuple[str, str]] = []

    def __getattr__(self, name: str):  # noqa: ANN204 - description, prune_grace_s, listings, downloads
        return getattr(self.inner, name)

    def put_file(self, where: str, name: str, source: Path) -> RemoteFile:
        self.puts.append((where, name))
        return self.inner.put_file(where, name, source)

    def delete_file(self, where: str, name: str) -> None:
        self.deletes.append((where, name))
        self.inner.delete_file(where, name)

    def delete_folder(self, where: str) -> None:
        self.deletes.append((where, "*"))
        self.inner.delete_folder(where)

    def checkpoint_puts(self, where: str) -> set[str]:
        return {name for at, name in self.puts if at == where}


@pytest.fixture(params=["mounted", "drive"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Recording]:
    policy = RetryPolicy(attempts=4, base_s=0.001, sleep=lambda s: None)
    if request.param == "mounted":
        yield Recording(MountedDirStore(tmp_path / "mount", policy, prune_grace_s=0))
        return
    with FakeDrive() as fake:
        yield Recording(GDriveStore(make_drive(fake), DriveLocation.parse("gdrive://root/runs/reuse"), policy), fake)
        assert not fake.server_errors, fake.server_errors


def write_step(manager: CheckpointManager, step: int, files: dict[str, bytes | int], run_id: str = RUN) -> Path:
    """A committed checkpoint like the sharded writer makes: ``files`` maps a name to its bytes, or to an older
    step whose same-named file is hard-linked (the writer's way of not writing identical bytes twice)."""
    directory = manager.root / folder(step)
    directory.mkdir(parents=True)
    entries = {}
    for name, content in files.items():
        if isinstance(content, int):
            os.link(manager.root / folder(content) / name, directory / name)
        else:
            (directory / name).write_bytes(content)
        data = (directory / name).read_bytes()
        entries[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    body = {"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "step": step, "files": entries,
            "created_unix": time.time(), "run_id": run_id, "epoch": 0}
    fmt.write_json_atomic(directory / fmt.MANIFEST, seal(body))
    return directory


def payload(seed: int, size: int) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (size // 32)


def mirror_steps(mirror: Mirror, *steps: int) -> None:
    for step in steps:
        mirror.submit(step)
    assert mirror.flush(60) == [], mirror.errors
    assert not mirror.errors, mirror.errors


def remote_manifest_of(remote: Recording, step: int, tmp: Path) -> dict:
    target = tmp / f"remote-manifest-{step}.json"
    remote.get_file(folder(step), fmt.MANIFEST, target)
    return parse(target.read_bytes(), step).body  # validated (placements, self-checksum) like any manifest


def two_steps(tmp_path: Path, remote: Recording) -> tuple[CheckpointManager, Mirror]:
    """Step 1 (meta, two shards) mirrored; step 2 shares shard 0 with it (hard-linked) and mirrored."""
    run_dir = tmp_path / "run"
    local = CheckpointManager(checkpoints_dir(run_dir))
    write_step(local, 1, {META: b"meta one", SHARD0: payload(0, BIG), SHARD1: payload(1, 32_000)})
    mirror = Mirror(local, remote, run_dir, print, run_id=RUN)
    mirror_steps(mirror, 1)
    write_step(local, 2, {META: b"meta two", SHARD0: 1, SHARD1: payload(2, 32_000)})
    mirror_steps(mirror, 2)
    return local, mirror


def test_an_unchanged_shard_is_not_uploaded_again(tmp_path: Path, remote: Recording) -> None:
    local, mirror = two_steps(tmp_path, remote)
    mirror.close(30)
    assert os.path.samefile(local.root / folder(1) / SHARD0, local.root / folder(2) / SHARD0)
    assert remote.checkpoint_puts(folder(1)) == {META, SHARD0, SHARD1, fmt.MANIFEST}
    assert remote.checkpoint_puts(folder(2)) == {META, SHARD1, fmt.MANIFEST}
    assert [name for at, name in remote.puts if at == folder(2)][-1] == fmt.MANIFEST  # still last
    assert SHARD0 not in remote.list_files(folder(2))
    body = remote_manifest_of(remote, 2, tmp_path)
    assert body["files"][SHARD0]["folder"] == folder(1)
    assert "folder" not in body["files"][SHARD1] and "folder" not in body["files"][META]
    local_body = read(local.root / folder(2)).body
    assert {n: {k: v for k, v in e.items() if k not in ("folder", "md5")} for n, e in body["files"].items()} \
        == local_body["files"]
    if remote.fake is not None:  # Drive reports md5s: the remote manifest records those of the files sent here
        md5 = {n: hashlib.md5((local.root / folder(2) / n).read_bytes()).hexdigest() for n in (META, SHARD1)}
        assert {n: e.get("md5") for n, e in body["files"].items()} == {**md5, SHARD0: None}
    assert durable_steps(remote, tmp_path, RUN) == [1, 2]
    sizes = {name: (local.root / folder(1) / name).stat().st_size for name in (META, SHARD0, SHARD1)}
    step2 = len(b"meta two") + 32_000
    assert mirror.bytes == sum(sizes.values()) + step2
    assert mirror.reused_bytes == sizes[SHARD0]


def test_a_small_unchanged_file_is_uploaded_again(tmp_path: Path, remote: Recording) -> None:
    """Below MIN_REUSE_BYTES reusing saves nothing, and would keep a pruned folder around just for that file."""
    local = CheckpointManager(checkpoints_dir(tmp_path / "run"))
    write_step(local, 1, {META: b"the same meta", SHARD0: payload(0, 32_000)})
    write_step(local, 2, {META: 1, SHARD0: 1})
    mirror = Mirror(local, remote, tmp_path / "run", print, run_id=RUN)
    mirror_steps(mirror, 1)
    mirror_steps(mirror, 2)
    local.delete(local.root / folder(1))
    mirror_steps(mirror)
    mirror.close(30)
    assert remote.checkpoint_puts(folder(2)) == {META, SHARD0, fmt.MANIFEST} and mirror.reused_bytes == 0
    assert remote.list_checkpoints() == [folder(2)]


def test_a_fresh_machine_brings_back_files_from_both_folders(tmp_path: Path, remote: Recording) -> None:
    local, mirror = two_steps(tmp_path, remote)
    mirror.close(30)
    fresh_dir = tmp_path / "fresh"
    fresh = CheckpointManager(checkpoints_dir(fresh_dir))
    said: list[str] = []
    assert restore_newest(remote, fresh, fresh_dir, said.append) == 2
    latest, skipped = fresh.latest_valid()  # deep: every file's sha256 checked
    assert latest is not None and latest.step == 2 and not skipped
    for name in (META, SHARD0, SHARD1):
        assert (fresh.root / folder(2) / name).read_bytes() == (local.root / folder(2) / name).read_bytes()
    assert not any("warning" in line for line in said), said


def test_a_pruned_checkpoint_keeps_the_files_newer_ones_use(tmp_path: Path, remote: Recording) -> None:
    local, mirror = two_steps(tmp_path, remote)
    local.delete(local.root / folder(1))  # local retention dropped step 1: the remote follows
    mirror_steps(mirror)
    files = remote.list_files(folder(1))
    assert set(files) == {SHARD0}, files  # its manifest and the files nothing uses are gone
    assert (folder(1), fmt.MANIFEST) in remote.deletes
    assert remote.deletes.index((folder(1), fmt.MANIFEST)) < remote.deletes.index((folder(1), META))
    entries = {e["step"]: e for e in describe_remote(remote, tmp_path)}
    assert not entries[1]["durable"] and entries[1]["reason"] == HOLDER
    assert durable_steps(remote, tmp_path, RUN) == [2]
    said: list[str] = []
    fresh_dir = tmp_path / "fresh"
    assert restore_newest(remote, CheckpointManager(checkpoints_dir(fresh_dir)), fresh_dir, said.append) == 2
    assert not any("incomplete" in line or "skipping" in line for line in said), said
    mirror.close(30)

    # A new process (resumed on another VM) finds the holder, keeps it, and reuses it for a frozen shard.
    mirror = Mirror(local, remote, tmp_path / "run", print, run_id=RUN)
    remote.puts.clear()
    write_step(local, 3, {META: b"meta three", SHARD0: 2, SHARD1: payload(3, 32_000)})
    local.delete(local.root / folder(2))
    mirror_steps(mirror, 3)
    assert remote.checkpoint_puts(folder(3)) == {META, SHARD1, fmt.MANIFEST}
    assert remote_manifest_of(remote, 3, tmp_path)["files"][SHARD0]["folder"] == folder(1)
    assert remote.list_checkpoints() == [folder(1), folder(3)]  # step 2 held nothing anyone uses: gone
    assert set(remote.list_files(folder(1))) == {SHARD0}
    fresh_dir = tmp_path / "fresh-3"
    assert restore_newest(remote, CheckpointManager(checkpoints_dir(fresh_dir)), fresh_dir, print) == 3

    # New bytes for every file: once step 3 is pruned, nothing uses the holder and it goes.
    write_step(local, 4, {META: b"meta four", SHARD0: payload(4, BIG), SHARD1: payload(5, 32_000)})
    local.delete(local.root / folder(3))
    mirror_steps(mirror, 4)
    assert remote.list_checkpoints() == [folder(4)]
    assert durable_steps(remote, tmp_path, RUN) == [4]
    mirror.close(30)


def test_a_reused_file_whose_folder_vanished_is_uploaded_again(tmp_path: Path, remote: Recording) -> None:
    run_dir = tmp_path / "run"
    local = CheckpointManager(checkpoints_dir(run_dir))
    write_step(local, 1, {META: b"meta one", SHARD0: payload(0, BIG)})
    mirror = Mirror(local, remote, run_dir, print, run_id=RUN)
    mirror_steps(mirror, 1)
    remote.inner.delete_folder(folder(1))  # someone deleted it on Drive
    write_step(local, 2, {META: b"meta two", SHARD0: 1})
    mirror_steps(mirror, 2)
    mirror.close(30)
    assert remote.checkpoint_puts(folder(2)) == {META, SHARD0, fmt.MANIFEST}
    assert "folder" not in remote_manifest_of(remote, 2, tmp_path)["files"][SHARD0]
    assert mirror.reused_bytes == 0
    assert durable_steps(remote, tmp_path, RUN) == [2]


def test_only_files_of_the_same_run_are_reused(tmp_path: Path, remote: Recording) -> None:
    other = CheckpointManager(checkpoints_dir(tmp_path / "other"))
    write_step(other, 1, {META: b"meta", SHARD0: payload(0, BIG)}, run_id="run-other")
    mirror = Mirror(other, remote, tmp_path / "other", print, run_id="run-other")
    mirror_steps(mirror, 1)
    mirror.close(30)
    local = CheckpointManager(checkpoints_dir(tmp_path / "run"))
    write_step(local, 2, {META: b"meta", SHARD0: payload(0, BIG)})  # the same bytes, but not this run's
    mirror = Mirror(local, remote, tmp_path / "run", print, run_id=RUN)
    mirror_steps(mirror, 2)
    mirror.close(30)
    assert remote.checkpoint_puts(folder(2)) == {META, SHARD0, fmt.MANIFEST} and mirror.reused_bytes == 0


def _upload_manifest(remote: Recording, tmp: Path, step: int, files: dict[str, dict]) -> None:
    body = seal({"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "step": step, "files": files,
                 "created_unix": time.time(), "run_id": RUN})
    path = tmp / f"hand-made-{step}.json"
    fmt.write_json_atomic(path, body)
    remote.put_file(folder(step), fmt.MANIFEST, path)


def test_a_placement_pointing_at_nothing_is_not_durable(tmp_path: Path, remote: Recording) -> None:
    local, mirror = two_steps(tmp_path, remote)
    mirror.close(30)
    meta = tmp_path / "meta"
    meta.write_bytes(b"meta")
    entry = {"size": 4, "sha256": hashlib.sha256(b"meta").hexdigest()}
    missing = {"size": 10, "sha256": "0" * 64}
    # Step 3 places a file in step 1's folder that is not there; step 4 one in a folder that never existed.
    remote.put_file(folder(3), META, meta)
    _upload_manifest(remote, tmp_path, 3, {META: entry, "shard-00007.safetensors": {**missing, "folder": folder(1)}})
    remote.put_file(folder(4), META, meta)
    _upload_manifest(remote, tmp_path, 4, {META: entry, SHARD0: {**missing, "folder": folder(0)}})
    entries = {e["step"]: e for e in describe_remote(remote, tmp_path)}
    assert not entries[3]["durable"] and "shard-00007.safetensors" in entries[3]["reason"] \
        and folder(1) in entries[3]["reason"], entries[3]
    assert not entries[4]["durable"] and SHARD0 in entries[4]["reason"] and folder(0) in entries[4]["reason"]
    assert durable_steps(remote, tmp_path, RUN) == [1, 2]
    said: list[str] = []
    fresh_dir = tmp_path / "fresh"
    fresh = CheckpointManager(checkpoints_dir(fresh_dir))
    assert restore_newest(remote, fresh, fresh_dir, said.append) == 2
    assert fresh.latest_valid()[0].step == 2
    assert sum("skipping remote" in line for line in said) == 2, said

    # The shard step 2 reuses vanishes from step 1's folder: step 2 is not durable, and step 1 is the newest.
    remote.inner.delete_file(folder(1), SHARD0)
    assert durable_steps(remote, tmp_path, RUN) == []
    remote.inner.delete_folder(folder(2))
    _, mirror = two_steps(tmp_path / "again", remote)  # a fresh upload of both: step 1's shard is back
    mirror.close(30)
    assert durable_steps(remote, tmp_path, RUN) == [1, 2]


def test_delete_file_is_permanent_and_quiet_when_missing(tmp_path: Path, remote: Recording) -> None:
    source = tmp_path / "f"
    source.write_bytes(b"x" * 100)
    remote.put_file(folder(1), "a", source)
    remote.put_file(folder(1), "b", source)
    remote.delete_file(folder(1), "a")
    remote.delete_file(folder(1), "a")  # already gone: no error
    remote.delete_file(folder(9), "a")  # no such folder: no error
    assert set(remote.list_files(folder(1))) == {"b"}
    if remote.fake is None:  # unlinked, not moved anywhere
        assert sorted(p.name for p in (remote.inner.root / "checkpoints" / folder(1)).iterdir()) == ["b"]
    else:  # deleted by id, not trashed: a trashed file still fills the quota
        with remote.fake.lock:
            titles = [f.title for f in remote.fake.files.values()]
            assert not any(f.trashed for f in remote.fake.files.values())
        assert titles.count("a") == 0 and titles.count("b") == 1


def test_inspect_shows_a_holder_as_pruned_not_invalid() -> None:
    from resumable.cli import checkpoint_status

    holder = {"valid": False, "durable": False, "reason": HOLDER}
    assert checkpoint_status(holder) == f"pruned: {HOLDER}"
    assert checkpoint_status({"valid": False, "reason": "incomplete upload (x is missing)"}).startswith("INVALID")
    assert checkpoint_status({"valid": True, "durable": True, "reason": None}) == "durable on Drive"
