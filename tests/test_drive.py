"""Google Drive storage against a loopback Drive v2 server: the real pydrive2/googleapiclient/httplib2
stack over real sockets, with faults injected by the server (see tests/fakedrive/)."""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from fakedrive import FakeDrive, make_drive
from helpers import command, env, final_fingerprint, payload_files, records, run

from resumable.checkpoint import CheckpointManager, checkpoints_dir, fingerprint
from resumable.checkpoint.sharded import shard_name
from resumable.cli import main, train_command
from resumable.storage import StorageError, TransientStorageError, mounted
from resumable.storage.gdrive import DriveLocation, GDriveStore
from resumable.storage.retry import RetryPolicy
from resumable.storage.tiered import Mirror, durable_steps, restore_newest

FAST = {"RESUMABLE_RETRY_BASE_S": "0.01", "RESUMABLE_DRIVE_TIMEOUT": "2"}


@pytest.fixture
def fake():
    with FakeDrive() as server:
        yield server
        assert not server.server_errors, server.server_errors


def store(fake: FakeDrive, timeout: float = 5.0, path: str = "runs/t") -> GDriveStore:
    policy = RetryPolicy(attempts=6, base_s=0.01)
    return GDriveStore(make_drive(fake, timeout=timeout), DriveLocation.parse(f"gdrive://root/{path}"), policy)


def drive_env(fake: FakeDrive) -> dict[str, str]:
    return {"RESUMABLE_DRIVE_ENDPOINT": fake.base_url, "RESUMABLE_DRIVE_TOKEN": "fake-token", **FAST}


def live_files(fake: FakeDrive) -> list:
    with fake.lock:
        return [f for f in fake.files.values()]


def test_store_round_trip_overwrites_by_id_and_deletes_permanently(fake: FakeDrive, tmp_path: Path) -> None:
    s = store(fake)
    source = tmp_path / "state.pt"
    source.write_bytes(b"x" * 300_000)
    got = s.put_file("step-000000001", "state.pt", source)
    assert got.size == 300_000 and got.md5 is not None
    source.write_bytes(b"y" * 1000)
    s.put_file("step-000000001", "state.pt", source)  # the same name again: overwritten, not duplicated
    assert [f.title for f in live_files(fake)].count("state.pt") == 1
    assert s.list_checkpoints() == ["step-000000001"]
    assert s.list_files("step-000000001")["state.pt"].size == 1000
    s.get_file("step-000000001", "state.pt", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == b"y" * 1000
    s.delete_folder("step-000000001")
    assert s.list_checkpoints() == []
    assert not any(f.trashed for f in live_files(fake)), "pruned checkpoints must not go to the trash"
    assert not [f for f in live_files(fake) if f.title in ("state.pt", "step-000000001")]


@pytest.mark.parametrize("fault", ["userRateLimitExceeded", "rateLimitExceeded", "429", "500", "503",
                                   "html502", "html503", "drop", "close", "stall"])
@pytest.mark.parametrize("where", ["POST /upload/", "upload_id=", "GET /drive/v2/files?"])
def test_transient_faults_are_retried_without_duplicates(fake: FakeDrive, tmp_path: Path, fault: str,
                                                         where: str) -> None:
    s = store(fake, timeout=1.0)
    source = tmp_path / "state.pt"
    source.write_bytes(bytes(range(256)) * 2000)
    s.list_checkpoints()  # warm the folder cache so the fault lands where intended
    fake.inject(fault, count=1 if fault == "stall" else 2, match=where, seconds=1.5)
    got = s.put_file("step-000000003", "state.pt", source)
    assert got.size == source.stat().st_size
    assert fake.faults_fired, "the fault must have fired"
    assert s.policy.retries >= 1
    names = [f.title for f in live_files(fake) if not f.trashed]
    assert names.count("state.pt") == 1 and names.count("step-000000003") == 1
    s.get_file("step-000000003", "state.pt", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == source.read_bytes()


def test_storage_quota_exceeded_is_reported_not_retried(fake: FakeDrive, tmp_path: Path) -> None:
    s = store(fake)
    source = tmp_path / "state.pt"
    source.write_bytes(b"z" * 1000)
    fake.inject("storageQuotaExceeded", count=5, match="/upload/")
    with pytest.raises(StorageError, match="storageQuotaExceeded") as err:
        s.put_file("step-000000001", "state.pt", source)
    assert not isinstance(err.value, TransientStorageError)
    assert s.policy.retries == 0 and "empty its trash" in str(err.value)


def _local_checkpoints(root: Path, steps: list[int]) -> CheckpointManager:
    import torch

    manager = CheckpointManager(checkpoints_dir(root))
    for step in steps:
        model = {"w": torch.full((64, 64), float(step))}
        manager.save(step, {"model": model, "optimizer": {}}, {"fingerprint": fingerprint(model, {})})
    (root / "metrics.jsonl").write_text('{"step": 1}\n')
    return manager


def test_a_partially_uploaded_checkpoint_never_counts(fake: FakeDrive, tmp_path: Path) -> None:
    s = store(fake)
    local = _local_checkpoints(tmp_path / "run", [1])
    mirror = Mirror(local, s, tmp_path / "run", print)
    mirror.submit(1)
    assert mirror.flush(10) == []
    _local_checkpoints(tmp_path / "run", [2])
    payload = [p.name for p in payload_files(local.root / "step-000000002")]  # meta.pt and the shard, both small
    # Step 2: each payload file is a new file (a POST each) and its manifest another; fail the manifest's upload for
    # good.
    fake.inject("storageQuotaExceeded", count=1, match="POST /upload/", skip=len(payload))
    mirror.submit(2)
    assert mirror.flush(10) == [2] and mirror.errors
    mirror.close()
    listed = s.list_files("step-000000002")
    assert set(payload) <= set(listed) and "manifest.json" not in listed, (payload, listed, mirror.errors)
    assert durable_steps(s, tmp_path) == [1]
    fresh = CheckpointManager(checkpoints_dir(tmp_path / "fresh"))
    assert restore_newest(s, fresh, tmp_path / "fresh", print) == 1
    assert fresh.latest_valid()[0].step == 1


def test_a_checkpoint_pruned_while_listing_is_skipped(fake: FakeDrive, tmp_path: Path) -> None:
    """`inspect` beside a live run: the trainer prunes a folder between our listing and our reads."""
    writer, reader = store(fake), store(fake)
    mirror = Mirror(_local_checkpoints(tmp_path / "run", [1, 2]), writer, tmp_path / "run", print)
    mirror.submit(1)
    mirror.submit(2)
    assert mirror.flush(10) == []
    mirror.close()
    assert durable_steps(reader, tmp_path) == [1, 2]  # the reader now caches both folder ids
    listed = reader.list_checkpoints()
    writer.delete_folder("step-000000001")
    reader.list_checkpoints = lambda: listed  # type: ignore[method-assign]  # the listing predates the prune
    assert durable_steps(reader, tmp_path) == [2]


def _train_args(run_dir: str, data: Path, *extra: str) -> list[str]:
    return ["--run-dir", run_dir, "--data-dir", str(data), "--batch-size", "16", "--no-progress",
            "--no-download", *extra]


def test_rotation_keeps_two_plus_best_on_drive_and_nothing_in_trash(fake: FakeDrive, tiny_mnist: Path,
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in drive_env(fake).items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(train_command, _train_args(
        "gdrive://root/runs/rot", tiny_mnist, "--max-steps", "10", "--checkpoint-steps", "1", "--keep", "2",
        "--cache-dir", str(tmp_path / "cache")))
    assert result.exit_code == 0, result.output
    s = store(fake, path="runs/rot")
    assert durable_steps(s, tmp_path) == [6, 9, 10]  # 2 newest + the best (the epoch-end checkpoint)
    assert not any(f.trashed for f in live_files(fake))
    assert len([f for f in live_files(fake) if f.title.startswith("step-")]) == 3
    listing = json.loads(CliRunner().invoke(main, ["inspect", "--json", "gdrive://root/runs/rot"]).output)
    assert [c["step"] for c in listing["checkpoints"] if c["durable"]] == [6, 9, 10]


def test_tensorboard_events_are_mirrored_and_come_back_on_a_fresh_vm(fake: FakeDrive, tiny_mnist: Path,
                                                                     tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for key, value in drive_env(fake).items():
        monkeypatch.setenv(key, value)
    args = ["--checkpoint-steps", "2", "--tensorboard", "--log-every", "1"]
    first = CliRunner().invoke(train_command, _train_args(
        "gdrive://root/runs/tb", tiny_mnist, *args, "--max-steps", "10", "--cache-dir", str(tmp_path / "vm1")))
    assert first.exit_code == 0, first.output
    s = store(fake, path="runs/tb")
    assert s.list_files("tensorboard"), "the event files are on Drive"
    assert "tensorboard" not in s.list_checkpoints()
    # The VM dies after the events of steps 9-10 reached Drive but before step 10's checkpoint did:
    s.delete_folder("step-000000010")
    second = CliRunner().invoke(train_command, _train_args(
        "gdrive://root/runs/tb", tiny_mnist, *args, "--max-steps", "16", "--cache-dir", str(tmp_path / "vm2")))
    assert second.exit_code == 0, second.output
    assert "brought checkpoint step 8 back" in second.output and "resuming from step 8" in second.output
    (cache,) = (tmp_path / "vm2").iterdir()
    events = EventAccumulator(str(cache / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/lr")] == list(range(1, 17)), "each step once, across both VMs"
    assert len(s.list_files("tensorboard")) == 2  # one event file per session, both on Drive
    third = CliRunner().invoke(train_command, _train_args(
        "gdrive://root/runs/tb", tiny_mnist, *args, "--max-steps", "4", "--cache-dir", str(tmp_path / "vm2"),
        "--fresh", "--overwrite"))
    assert third.exit_code == 0, third.output
    s = store(fake, path="runs/tb")  # a new client: the folder ids the old one cached were deleted
    assert len(s.list_files("tensorboard")) == 1 and len(list((cache / "tensorboard").iterdir())) == 1, \
        "starting over drops the old run's curves, here and on Drive"


def test_quota_exceeded_keeps_training_state_committed_locally(fake: FakeDrive, tiny_mnist: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in drive_env(fake).items():
        monkeypatch.setenv(key, value)
    fake.quota_bytes = 10_000
    result = CliRunner().invoke(train_command, _train_args(
        "gdrive://root/runs/q", tiny_mnist, "--max-steps", "4", "--cache-dir", str(tmp_path / "cache")))
    assert result.exit_code == 74, result.output  # EXIT_NOT_DURABLE: step 4 is only in this VM's cache
    assert "storageQuotaExceeded" in result.output and "exist only in" in result.output
    assert "only local: steps 4" in result.output
    (cache,) = (tmp_path / "cache").iterdir()
    assert CheckpointManager(checkpoints_dir(cache)).latest_valid()[0].step == 4


def kill_once_durable(fake: FakeDrive, args: list[str], step: int, scratch: Path, settle_s: float = 0.0) -> int:
    """Train ``args`` on the fake, SIGKILL it once a checkpoint at ``step`` or later is durable on Drive (listed
    ``settle_s`` after the kill) and return the newest durable step, asserted to be before the run's end (120)."""
    proc = subprocess.Popen(command() + args, env=env(**drive_env(fake)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    s = store(fake)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        steps = durable_steps(s, scratch)
        if steps and steps[-1] >= step:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate()
    time.sleep(settle_s)
    killed_at = durable_steps(s, scratch)[-1]
    assert step <= killed_at < 120, f"the kill must land mid-run (durable step {killed_at}):\n{stderr[-3000:]}"
    return killed_at


# Soak set (about 25 s): the default run has the same kill -> fresh VM -> identical path with every Drive
# behaviour on at once (test_drive_api_behaviour.py).
@pytest.mark.soak
def test_kill_delete_cache_resume_from_drive_is_identical(fake: FakeDrive, tiny_mnist: Path,
                                                          tmp_path: Path) -> None:
    extra = ["--epochs", "20", "--checkpoint-steps", "10", "--log-every", "1"]
    reference = run(_train_args(str(tmp_path / "local"), tiny_mnist, *extra))
    assert reference.returncode == 0, reference.stderr
    cache = tmp_path / "cache"
    args = _train_args("gdrive://root/runs/t", tiny_mnist, *extra, "--cache-dir", str(cache))
    s = store(fake)
    kill_once_durable(fake, args, 20, tmp_path)
    shutil.rmtree(cache)  # a fresh VM: nothing local survives
    final = run(args, **drive_env(fake))
    assert final.returncode == 0, final.stderr
    assert "brought checkpoint step" in final.stderr and "resuming from step" in final.stderr
    (local,) = cache.iterdir()
    assert final_fingerprint(local) == final_fingerprint(tmp_path / "local")
    assert records(local) == records(tmp_path / "local")
    assert durable_steps(s, tmp_path)[-1] == 120


def test_mounted_store_keeps_run_folders_beside_the_checkpoints(tmp_path: Path) -> None:
    s = mounted.MountedDirStore(tmp_path / "run")
    log = tmp_path / "events"
    log.write_bytes(b"x" * 10)
    s.put_file("tensorboard", "events.out", log)
    s.put_file("step-000000002", "state.pt", log)
    assert (tmp_path / "run" / "tensorboard" / "events.out").is_file()
    assert s.list_checkpoints() == ["step-000000002"] and s.list_files("tensorboard")["events.out"].size == 10
    s.delete_folder("tensorboard")
    s.delete_folder("tensorboard")  # already gone: no error
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_flaky_mounted_drive_is_retried(tiny_mnist: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mount = tmp_path / "drive"
    monkeypatch.setenv("RESUMABLE_DRIVE_MOUNT", str(mount))
    monkeypatch.setenv("RESUMABLE_RETRY_BASE_S", "0.01")
    real_copy = shutil.copyfileobj
    calls = []

    def flaky(src, dst, length=0):
        calls.append(1)
        if len(calls) % 2:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")
        return real_copy(src, dst, length)

    monkeypatch.setattr(mounted.shutil, "copyfileobj", flaky)
    run_dir = mount / "MyDrive" / "runs" / "m"
    result = CliRunner().invoke(train_command, _train_args(str(run_dir), tiny_mnist, "--max-steps", "8",
                                                           "--checkpoint-steps", "4", "--cache-dir",
                                                           str(tmp_path / "cache")))
    assert result.exit_code == 0, result.output
    assert len(calls) >= 4
    manager = CheckpointManager(checkpoints_dir(run_dir))
    assert [i.step for i in manager.inspect() if i.valid] == [4, 6, 8]
    assert not list(run_dir.rglob("*.tmp-*"))


def test_missing_credentials_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RESUMABLE_DRIVE_TOKEN", "RESUMABLE_DRIVE_CREDENTIALS", "COLAB_RELEASE_TAG"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    import resumable.storage.auth as auth

    monkeypatch.setattr(auth, "DEFAULT_TOKEN", tmp_path / "none.json")
    result = CliRunner().invoke(train_command, ["--run-dir", "gdrive://root/runs/x", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "drive-login" in result.output and "--drive-credentials" in result.output


def test_drive_login_saves_token_privately(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from oauth2client.client import AccessTokenCredentials
    from pydrive2.auth import GoogleAuth

    def fake_flow(self) -> None:
        self.credentials = AccessTokenCredentials("secret-token-value", "resumable")

    monkeypatch.setattr(GoogleAuth, "CommandLineAuth", fake_flow)
    secrets_file = tmp_path / "client_secrets.json"
    secrets_file.write_text(json.dumps({"installed": {"client_id": "x", "client_secret": "y",
                                                      "auth_uri": "a", "token_uri": "t",
                                                      "redirect_uris": ["urn:ietf:wg:oauth:2.0:oob"]}}))
    token = tmp_path / "token.json"
    result = CliRunner().invoke(main, ["drive-login", "--client-secrets", str(secrets_file), "--token", str(token)])
    assert result.exit_code == 0, result.output
    assert token.stat().st_mode & 0o777 == 0o600
    assert "secret-token-value" in token.read_text() and "secret-token-value" not in result.output


def test_drive_lease_one_machine_at_a_time(fake: FakeDrive) -> None:
    import json as _json

    from resumable.errors import RunDirInUse
    from resumable.storage.lease import DriveLease

    s = store(fake)
    first = DriveLease(s, heartbeat_s=60, settle_s=0)
    assert first.acquire() is None
    with pytest.raises(RunDirInUse, match="is being trained by process"):
        DriveLease(s, settle_s=0).acquire()
    first.release()
    second = DriveLease(s, settle_s=0)
    assert second.acquire() is None  # a released lease is free
    second.release()
    # A lease from another machine that stopped renewing it is taken over.
    silent = {"pid": 1, "host": "another-vm", "token": "x", "started": "earlier", "heartbeat": time.time() - 3600}
    with fake.lock:
        lease_file = next(f for f in fake.files.values() if f.title == "lease.json")
        lease_file.content = _json.dumps(silent).encode()
    third = DriveLease(s, settle_s=0)
    message = third.acquire()
    assert message and "another-vm" in message and "heartbeat" in message
    third.release()


def test_fresh_overwrite_on_drive_replaces_the_old_run(fake: FakeDrive, tiny_mnist: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in drive_env(fake).items():
        monkeypatch.setenv(key, value)
    args = _train_args("gdrive://root/runs/fresh", tiny_mnist, "--max-steps", "6", "--cache-dir", str(tmp_path))
    assert CliRunner().invoke(train_command, args).exit_code == 0
    old = store(fake, path="runs/fresh").list_files("step-000000006")[shard_name(0)]  # the weights
    result = CliRunner().invoke(train_command, [*args, "--fresh", "--overwrite", "--seed", "5"])
    assert result.exit_code == 0, result.output
    s = store(fake, path="runs/fresh")
    assert durable_steps(s, tmp_path) == [6]
    assert s.list_files("step-000000006")[shard_name(0)].md5 != old.md5, "the new run's step 6 was uploaded"
