"""Regression tests for four storage bugs: retry jitter drew from the global RNG; the mirror pruned the
previous checkpoint on a Drive mount before the mount had uploaded the new one; the mirror kept calling the
remote after close(); and a stale local cache of an old run beat a newer run on Drive."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import torch

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.storage.base import RemoteFile
from resumable.storage.gdrive import GDriveStore
from resumable.storage.mounted import MountedDirStore
from resumable.storage.retry import RetryPolicy, TransientStorageError
from resumable.storage.tiered import Mirror, durable_steps, restore_newest


def _fast() -> RetryPolicy:
    return RetryPolicy(attempts=3, base_s=0.001, sleep=lambda s: None)


def _save(manager: CheckpointManager, step: int, run_id: str | None = None) -> None:
    meta = {"run_id": run_id} if run_id is not None else {}
    manager.save(step, {"model": {"w": torch.full((8,), float(step))}}, meta)


def _remote_steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (root / "checkpoints").iterdir())


def _populate(remote: MountedDirStore, tmp: Path, run_id: str, steps: list[int]) -> None:
    """Put ``steps`` of run ``run_id`` on ``remote`` the way a run does: through a Mirror."""
    manager = CheckpointManager(checkpoints_dir(tmp))
    for step in steps:
        _save(manager, step, run_id)
    (tmp / "metrics.jsonl").write_text(f'{{"step": {steps[-1]}, "run": "{run_id}"}}\n')
    mirror = Mirror(manager, remote, tmp, lambda line: None, run_id=run_id)
    mirror.submit(steps[-1])
    assert mirror.flush(30) == []
    assert mirror.close(30)


# -- 1: retry jitter -------------------------------------------------------------------------------------
def test_retry_jitter_leaves_the_global_random_stream_alone() -> None:
    random.seed(1234)
    before = random.getstate()
    policy = RetryPolicy(attempts=6, base_s=0.5, sleep=lambda s: None)
    failures = iter(range(5))

    def flaky() -> str:
        if next(failures, None) is not None:
            raise OSError("reset")
        return "ok"

    assert policy.call(flaky, lambda e: TransientStorageError(str(e)), "test call") == "ok"
    assert policy.retries == 5
    assert random.getstate() == before  # training's Python RNG stream is untouched by a network fault
    # equal jitter (retry.RetryPolicy): between half and all of base·2^(k+1), capped
    assert all(min(policy.max_s, policy.base_s * 2 ** (k + 1)) / 2 <= policy.delay(k)
               <= min(policy.max_s, policy.base_s * 2 ** (k + 1)) for k in range(10))


# -- 2: prune grace on a mount ---------------------------------------------------------------------------
def test_mount_keeps_the_previous_checkpoint_until_the_new_one_had_time_to_upload(tmp_path: Path) -> None:
    assert GDriveStore.prune_grace_s == 0  # the API verifies md5 before a checkpoint counts: no grace needed
    assert MountedDirStore(tmp_path / "x").prune_grace_s > 0
    now = [1000.0]
    mount = tmp_path / "drive"
    remote = MountedDirStore(mount, _fast(), prune_grace_s=60)
    local = CheckpointManager(checkpoints_dir(tmp_path / "run"))
    mirror = Mirror(local, remote, tmp_path / "run", print, clock=lambda: now[0])
    _save(local, 1)
    mirror.submit(1)
    assert mirror.flush(30) == []
    now[0] += 5
    _save(local, 2)
    local.prune(keep=1, keep_best=False)
    mirror.submit(2)
    assert mirror.flush(30) == []
    assert _remote_steps(mount) == [1, 2]  # step 2 may still be only in the FUSE cache
    now[0] += 30
    assert mirror.flush(30) == [] and _remote_steps(mount) == [1, 2]  # 30 s < 60 s
    now[0] += 31
    assert mirror.flush(30) == []  # flush prunes too
    assert _remote_steps(mount) == [2]
    # A third checkpoint: step 2 (settled) stays until step 3 has been there for the grace too.
    _save(local, 3)
    local.prune(keep=1, keep_best=False)
    mirror.submit(3)
    assert mirror.flush(30) == [] and _remote_steps(mount) == [2, 3]
    now[0] += 61
    mirror.submit(3)
    assert mirror.flush(30) == [] and _remote_steps(mount) == [3]
    assert mirror.close(30)


# -- 3: close stops the mirror ---------------------------------------------------------------------------
class _SlowRecordingStore:
    """A mounted folder whose uploads take a while; every call is recorded with its start time."""

    def __init__(self, root: Path) -> None:
        self.inner = MountedDirStore(root, _fast(), prune_grace_s=0)
        self.description = "slow recording store"
        self.prune_grace_s = 0.0
        self.calls: list[tuple[float, str]] = []
        self.uploading = threading.Event()

    def _record(self, name: str) -> None:
        self.calls.append((time.monotonic(), name))

    def list_checkpoints(self) -> list[str]:
        self._record("list_checkpoints")
        return self.inner.list_checkpoints()

    def list_files(self, folder: str) -> dict[str, RemoteFile]:
        self._record("list_files")
        return self.inner.list_files(folder)

    def put_file(self, folder: str, name: str, source: Path) -> RemoteFile:
        self._record("put_file")
        self.uploading.set()
        time.sleep(0.3)
        return self.inner.put_file(folder, name, source)

    def get_file(self, folder: str, name: str, target: Path) -> None:
        self._record("get_file")
        self.inner.get_file(folder, name, target)

    def delete_folder(self, folder: str) -> None:
        self._record("delete_folder")
        self.inner.delete_folder(folder)


def test_no_remote_call_happens_after_close_returns(tmp_path: Path) -> None:
    local = CheckpointManager(checkpoints_dir(tmp_path / "run"))
    for step in (1, 2, 3, 4):
        _save(local, step)
    remote = _SlowRecordingStore(tmp_path / "drive")
    mirror = Mirror(local, remote, tmp_path / "run", print)
    mirror.submit(4)
    assert remote.uploading.wait(10)
    assert mirror.close(timeout=10) is True  # the upload in progress finishes; nothing new starts
    closed_at = time.monotonic()
    time.sleep(1.0)
    late = [name for at, name in remote.calls if at >= closed_at]
    assert late == [], late
    assert mirror.pending()  # not everything was uploaded: close does not wait for the queue (flush does)


# -- 4: run ids ------------------------------------------------------------------------------------------
def test_a_newer_run_on_drive_beats_a_stale_local_cache_of_an_old_run(tmp_path: Path) -> None:
    cache = CheckpointManager(checkpoints_dir(tmp_path / "cache"))
    for step in (400, 500):
        _save(cache, step, "run-a")
    (tmp_path / "cache" / "metrics.jsonl").write_text('{"step": 500}\n')
    time.sleep(0.01)  # run B is started later, on another VM, with --fresh --overwrite
    remote = MountedDirStore(tmp_path / "drive", _fast(), prune_grace_s=0)
    _populate(remote, tmp_path / "vm-b", "run-b", [50, 100])
    said: list[str] = []
    assert restore_newest(remote, cache, tmp_path / "cache", said.append) == 100
    latest, _ = cache.latest_valid()
    assert latest is not None and latest.step == 100 and latest.manifest["run_id"] == "run-b"
    assert [info.step for info in cache.inspect()] == [100]  # run A's checkpoints are gone from the cache
    stale = [line for line in said if "run-a" in line and "run-b" in line]
    assert len(stale) == 1 and "500" in stale[0] and "100" in stale[0], said
    assert '"run": "run-b"' in (tmp_path / "cache" / "metrics.jsonl").read_text()  # run A's logs went too


def test_restore_keeps_a_local_cache_of_the_same_or_an_unknown_run(tmp_path: Path) -> None:
    remote = MountedDirStore(tmp_path / "drive", _fast(), prune_grace_s=0)
    _populate(remote, tmp_path / "vm-b", "run-b", [100])
    cache = CheckpointManager(checkpoints_dir(tmp_path / "cache"))
    _save(cache, 500)  # an old manifest without run_id: compatible with anything
    assert restore_newest(remote, cache, tmp_path / "cache", print) is None
    assert [info.step for info in cache.inspect()] == [500]


def test_restore_keeps_a_local_run_newer_than_the_remote_one(tmp_path: Path) -> None:
    # Run A's folders were left on Drive by a failed delete; run C started here later and never uploaded.
    remote = MountedDirStore(tmp_path / "drive", _fast(), prune_grace_s=0)
    _populate(remote, tmp_path / "vm-a", "run-a", [500])
    time.sleep(0.01)
    cache = CheckpointManager(checkpoints_dir(tmp_path / "cache"))
    _save(cache, 20, "run-c")
    said: list[str] = []
    assert restore_newest(remote, cache, tmp_path / "cache", said.append) is None
    assert [(i.step, i.manifest["run_id"]) for i in cache.inspect()] == [(20, "run-c")]
    assert any("keeping the cache" in line for line in said), said


def test_restore_picks_the_remote_run_by_creation_not_by_step(tmp_path: Path) -> None:
    remote = MountedDirStore(tmp_path / "drive", _fast(), prune_grace_s=0)
    _populate(remote, tmp_path / "vm-a", "run-a", [500])  # a leftover of an older run
    time.sleep(0.01)
    _populate(remote, tmp_path / "vm-b", "run-b", [100])
    fresh = CheckpointManager(checkpoints_dir(tmp_path / "fresh"))
    assert restore_newest(remote, fresh, tmp_path / "fresh", print) == 100
    assert fresh.latest_valid()[0].manifest["run_id"] == "run-b"


def test_a_mirror_never_deletes_or_counts_another_runs_checkpoints(tmp_path: Path) -> None:
    mount = tmp_path / "drive"
    remote = MountedDirStore(mount, _fast(), prune_grace_s=0)
    _populate(remote, tmp_path / "vm-a", "run-a", [1, 2])
    assert durable_steps(remote, tmp_path, run_id="run-b") == []
    assert durable_steps(remote, tmp_path) == [1, 2]
    local = CheckpointManager(checkpoints_dir(tmp_path / "run"))
    mirror = Mirror(local, remote, tmp_path / "run", print, run_id="run-b")
    assert mirror.durable == set()  # run A's steps are not durable steps of run B
    for step in (2, 5, 6):  # step 2 collides with run A's: run B's own step 2 must be uploaded
        _save(local, step, "run-b")
        if step == 2:
            assert mirror.pending() == [2]
        mirror.submit(step)
        assert mirror.flush(30) == []
        local.prune(keep=1, keep_best=False)
    mirror.submit(6)
    assert mirror.flush(30) == []
    assert mirror.close(30)
    assert _remote_steps(mount) == [1, 6]  # run A's step 1 stays; run B's own 2 and 5 were pruned
    assert durable_steps(remote, tmp_path, run_id="run-a") == [1]
