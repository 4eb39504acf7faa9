"""A local checkpoint that retention deletes while its upload is pending (issue #15, item 5): a missing local file
is not a network error. The mirror skips that checkpoint at once (no retries, no failed upload at exit) and goes on
with the others, on the Drive API (loopback fake) and on a mounted folder."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from fakedrive import FakeDrive
from test_drive import _local_checkpoints, store

from resumable.checkpoint import paths
from resumable.storage import mounted
from resumable.storage import upload as upload_module
from resumable.storage.retry import RetryPolicy
from resumable.storage.tiered import Mirror, durable_steps

DOOMED = "step-000000002"


def test_drive_upload_of_a_file_deleted_under_it_is_skipped_not_retried(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention deletes step 2 once its upload has opened the shard; reading the open file then fails, as on a
    cache folder whose file system drops an unlinked file (the local disk keeps it readable, so the failure is
    made here)."""
    local = _local_checkpoints(tmp_path / "run", [1, 2])
    real_open = paths.open_regular

    class Vanishing:
        def __init__(self, handle) -> None:
            self.handle = handle

        def read(self, size: int = -1) -> bytes:
            if paths.is_real_dir(local.root / DOOMED):
                local.delete(local.root / DOOMED)  # retention ran: manifest first, then the files
            raise FileNotFoundError(errno.ENOENT, "No such file or directory")

        def __getattr__(self, name: str):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.handle.close()

    def opening(path):
        handle = real_open(path)
        return Vanishing(handle) if DOOMED in str(path) and path.name != "manifest.json" else handle

    monkeypatch.setattr(upload_module.paths, "open_regular", opening)
    with FakeDrive() as fake:
        s = store(fake)
        mirror = Mirror(local, s, tmp_path / "run", print)
        mirror.submit(2)
        pending = mirror.flush(30)
        mirror.close()
        print(f"retries: {s.policy.retries}; errors: {mirror.errors}; uploaded {mirror.bytes} bytes")
        assert not (local.root / DOOMED).exists(), "the deletion did happen mid-upload"
        assert s.policy.retries == 0, "a missing local file is not retried as a network error"
        assert mirror.errors == [], mirror.errors
        assert pending == [] and durable_steps(s, tmp_path) == [1], "the older checkpoint still went up"
        assert not fake.server_errors


def test_mounted_copy_of_a_checkpoint_deleted_meanwhile_is_skipped(tmp_path: Path) -> None:
    """The copy to a mounted Drive folder finds its source gone (retention ran between the listing and the copy)."""
    local = _local_checkpoints(tmp_path / "run", [1, 2])
    policy = RetryPolicy(attempts=6, base_s=0.01)
    s = mounted.MountedDirStore(tmp_path / "mount", policy, prune_grace_s=0)
    real_dir = s._dir

    def target_dir(folder: str) -> Path:  # called inside the copy, just before the source is opened
        if folder == DOOMED and paths.is_real_dir(local.root / DOOMED):
            local.delete(local.root / DOOMED)
        return real_dir(folder)

    s._dir = target_dir  # type: ignore[method-assign]
    mirror = Mirror(local, s, tmp_path / "run", print)
    mirror.submit(2)
    pending = mirror.flush(30)
    mirror.close()
    print(f"retries: {policy.retries}; errors: {mirror.errors}")
    assert not (local.root / DOOMED).exists()
    assert policy.retries == 0 and mirror.errors == [], mirror.errors
    assert pending == [] and durable_steps(s, tmp_path) == [1], "the older checkpoint still went up"


def test_an_unreadable_file_of_a_kept_checkpoint_is_still_a_failure(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The skip is for a checkpoint retention dropped: a read error on one still kept locally is reported."""
    local = _local_checkpoints(tmp_path / "run", [1])
    real_open = paths.open_regular

    class Broken:
        def __init__(self, handle) -> None:
            self.handle = handle

        def read(self, size: int = -1) -> bytes:
            raise OSError(errno.EIO, "Input/output error")

        def __getattr__(self, name: str):
            return getattr(self.handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.handle.close()

    monkeypatch.setattr(upload_module.paths, "open_regular",
                        lambda path: Broken(real_open(path)) if path.name != "manifest.json" else real_open(path))
    with FakeDrive() as fake:
        s = store(fake)
        mirror = Mirror(local, s, tmp_path / "run", print)
        mirror.submit(1)
        assert mirror.flush(30) == [1]
        mirror.close()
        assert s.policy.retries == 0, "a local disk error is not retried as a network error either"
        assert len(mirror.errors) == 1 and "Input/output error" in mirror.errors[0], mirror.errors


def test_retention_keeps_the_checkpoint_in_flight(tmp_path: Path) -> None:
    """Checkpoints that come faster than an upload takes: retention, pruning after each save, must keep the one being
    uploaded (Mirror.protected), or each newest would be pruned in its turn and nothing would become durable until
    training stopped (the budget test saw that: durable steps 12 and then only the last ones after the stop)."""
    local = _local_checkpoints(tmp_path / "run", [1, 2, 3])
    s = mounted.MountedDirStore(tmp_path / "mount", RetryPolicy(attempts=2, base_s=0.01), prune_grace_s=0)
    real_dir, seen = s._dir, {}
    mirror = Mirror(local, s, tmp_path / "run", print)

    def target_dir(folder: str) -> Path:  # inside the copy of a step, as a save's retention would run
        if folder == "step-000000002" and "pruned" not in seen:
            seen["protected"] = mirror.protected()
            seen["pruned"] = local.prune(1, False, mirror.protected())  # keep the newest (3) and what is in flight
        return real_dir(folder)

    s._dir = target_dir  # type: ignore[method-assign]
    mirror.submit(3)
    pending = mirror.flush(30)
    mirror.close()
    assert seen == {"protected": {2}, "pruned": [1]}, seen
    assert mirror.protected() == set() and mirror.errors == [], mirror.errors
    assert pending == [] and durable_steps(s, tmp_path) == [2, 3]
