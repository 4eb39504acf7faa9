"""Bringing a checkpoint back from Drive when downloads or remote files are damaged (issue #15, item 6), and the
mirror's pruning when the local cache is behind Drive, against the loopback Drive (tests/fakedrive/)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from fakedrive import FakeDrive
from test_drive import _local_checkpoints, _train_args, drive_env, store

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.cli import train_command
from resumable.storage.tiered import Mirror, durable_steps, restore_newest


@pytest.fixture
def fake():
    with FakeDrive() as server:
        yield server
        assert not server.server_errors, server.server_errors


def _mirror_all(fake: FakeDrive, root: Path, steps: list[int]) -> CheckpointManager:
    local = _local_checkpoints(root, steps)
    mirror = Mirror(local, store(fake), root, print)
    mirror.submit(steps[-1])
    assert mirror.flush(30) == []
    mirror.close()
    return local


def _damage(fake: FakeDrive, folder: str | None = None) -> list[str]:
    """Flip byte 0 of every shard on the fake (in ``folder`` only, if given): damaged on Drive itself, for good."""
    damaged = []
    with fake.lock:
        titles = {f.id: f.title for f in fake.files.values()}
        for f in fake.files.values():
            if f.title.startswith("shard-") and (folder is None or titles.get(f.parents[0]) == folder):
                f.content = bytes([f.content[0] ^ 0xFF]) + f.content[1:]
                damaged.append(f"{titles.get(f.parents[0])}/{f.title}")
    return damaged


def _snapshot(fake: FakeDrive) -> dict[str, tuple[str, str, str]]:
    """Every file but the lease (which each start writes) as id -> (title, md5, modified)."""
    with fake.lock:
        return {f.id: (f.title, f.md5, f.modified) for f in fake.files.values() if f.title != "lease.json"}


def test_a_download_damaged_in_transit_is_fetched_again(fake: FakeDrive, tmp_path: Path) -> None:
    _mirror_all(fake, tmp_path / "vm1", [1, 2])
    fake.corrupt_first_download = True  # every file's first download arrives with byte 0 flipped
    said: list[str] = []
    fresh = CheckpointManager(checkpoints_dir(tmp_path / "vm2"))
    assert restore_newest(store(fake), fresh, tmp_path / "vm2", said.append) == 2
    corrupted = [what for kind, _, what in fake.faults_fired if kind == "corrupt"]
    print(f"downloads damaged in transit: {corrupted}")
    assert "manifest.json" in corrupted and any(name.startswith("shard-") for name in corrupted)
    assert any("downloading it again" in line for line in said), said
    latest, _ = fresh.latest_valid()
    assert latest is not None and latest.step == 2, "the checkpoint brought back verifies (sha256 of every file)"
    assert (tmp_path / "vm2" / "metrics.jsonl").read_text() == '{"step": 1}\n', "the log came back undamaged"


@pytest.mark.parametrize("md5_recorded", [True, False])
def test_a_checkpoint_damaged_on_drive_falls_back_to_the_older_one(fake: FakeDrive, tmp_path: Path,
                                                                    md5_recorded: bool) -> None:
    local = _mirror_all(fake, tmp_path / "vm1", [1, 2])
    if not md5_recorded:  # a manifest as earlier versions wrote it (no md5s): damage shows once downloaded
        store(fake).put_file("step-000000002", "manifest.json", local.root / "step-000000002" / "manifest.json")
    assert _damage(fake, "step-000000002")
    with fake.lock:
        folder_id = next(f.id for f in fake.files.values() if f.title == "step-000000002")
        shards = {f.id for f in fake.files.values() if f.parents == [folder_id] and f.title.startswith("shard-")}
        seen = len(fake.requests)
    before = _snapshot(fake)
    said: list[str] = []
    fresh = CheckpointManager(checkpoints_dir(tmp_path / "vm2"))
    assert restore_newest(store(fake), fresh, tmp_path / "vm2", said.append) == 1
    with fake.lock:
        fetched = [p for _, p in fake.requests[seen:] if "alt=media" in p and p.split("/")[4].split("?")[0] in shards]
    if md5_recorded:  # Drive's md5 disagrees with the one recorded at upload: skipped without a download
        assert any("step-000000002" in line and "corrupt" in line for line in said), said
        assert fetched == []
    else:  # only the sha256 check of the downloaded bytes sees it, downloaded twice in case it was the transfer
        assert any("step-000000002" in line and "does not verify after 2 downloads" in line for line in said), said
        assert len(fetched) == 2 * len(shards), fetched
    assert [i.step for i in fresh.inspect()] == [1], "the damaged step left nothing behind in the cache"
    assert _snapshot(fake) == before, "nothing was changed on Drive"


def test_every_checkpoint_damaged_refuses_to_start_fresh(fake: FakeDrive, tiny_mnist: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in drive_env(fake).items():
        monkeypatch.setenv(key, value)
    args = _train_args("gdrive://root/runs/bad", tiny_mnist, "--checkpoint-steps", "2", "--keep", "3")
    first = CliRunner().invoke(train_command, [*args, "--max-steps", "4", "--cache-dir", str(tmp_path / "vm1")])
    assert first.exit_code == 0, first.output
    assert durable_steps(store(fake, path="runs/bad"), tmp_path) == [2, 4]
    damaged = _damage(fake)
    before = _snapshot(fake)
    second = CliRunner().invoke(train_command, [*args, "--max-steps", "8", "--cache-dir", str(tmp_path / "vm2")])
    print(second.output[-1500:])
    assert second.exit_code == 2, second.output
    assert "holds committed checkpoints of this run (steps 4, 2) but none could be brought back" in second.output
    assert "--fresh --overwrite" in second.output and "Nothing was changed there" in second.output
    assert _snapshot(fake) == before, f"Drive changed (damaged: {damaged})"
    assert "training on" not in second.output, "no step was trained"


def test_a_cache_behind_drive_never_prunes_drives_newer_checkpoints(fake: FakeDrive, tmp_path: Path) -> None:
    _mirror_all(fake, tmp_path / "vm1", [1, 2, 3, 4])
    shutil.copytree(tmp_path / "vm1", tmp_path / "vm2")
    behind = CheckpointManager(checkpoints_dir(tmp_path / "vm2"))
    for step in (3, 4):  # this VM's cache stopped at step 2
        behind.delete(behind.root / f"step-{step:09d}")
    s = store(fake)
    mirror = Mirror(behind, s, tmp_path / "vm2", print)
    mirror.submit(2)
    assert mirror.flush(30) == []
    assert durable_steps(s, tmp_path) == [1, 2, 3, 4], "steps 3 and 4 (ahead of this cache) stay on Drive"
    _local_checkpoints(tmp_path / "vm2", [5])  # this session's own newer checkpoint, uploaded by this mirror
    mirror.submit(5)
    assert mirror.flush(30) == []
    mirror.close()
    assert mirror.uploaded == {5}
    assert durable_steps(s, tmp_path) == [1, 2, 5], "once its own step 5 is durable, retention applies as usual"


def test_a_damaged_download_on_a_fresh_vm_resumes_bit_identical(fake: FakeDrive, tiny_mnist: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    straight = CliRunner().invoke(train_command, _train_args(str(tmp_path / "local"), tiny_mnist,
                                                             "--checkpoint-steps", "3", "--max-steps", "9",
                                                             "--log-every", "1"))
    assert straight.exit_code == 0, straight.output
    for key, value in drive_env(fake).items():
        monkeypatch.setenv(key, value)
    args = _train_args("gdrive://root/runs/again", tiny_mnist, "--checkpoint-steps", "3", "--log-every", "1")
    first = CliRunner().invoke(train_command, [*args, "--max-steps", "6", "--cache-dir", str(tmp_path / "vm1")])
    assert first.exit_code == 0, first.output
    fake.corrupt_first_download = True
    second = CliRunner().invoke(train_command, [*args, "--max-steps", "9", "--cache-dir", str(tmp_path / "vm2")])
    assert second.exit_code == 0, second.output
    assert "downloading it again" in second.output and "brought checkpoint step 6 back" in second.output
    assert "resuming from step 6" in second.output, second.output
    (cache,) = (tmp_path / "vm2").iterdir()

    def newest(root: Path) -> dict:
        latest, _ = CheckpointManager(checkpoints_dir(root)).latest_valid()
        assert latest is not None
        return latest.manifest

    assert newest(cache)["step"] == 9 and newest(cache)["fingerprint"] == newest(tmp_path / "local")["fingerprint"]
    steps = [json.loads(line)["step"] for line in (cache / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and sorted(set(steps)) == list(range(1, 10)), \
        f"the metrics log came back whole and continued: {steps}"
