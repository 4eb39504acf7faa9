"""Kill → fresh VM → identical, with the Drive API's real behaviours all on at once (issue #15): pages of 2 with a
nextPageToken, a listing that lags behind creates, answers lost after Drive acted (deletes, folder creates, an
upload chunk), same-titled duplicates of the run's logs and lease, and a corrupted first download of every file."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from fakedrive import FakeDrive
from helpers import command, env, final_fingerprint, records, run
from test_drive import _train_args, drive_env, kill_once_durable, store

from resumable.storage.tiered import durable_steps

LAG_S = 0.3


@pytest.fixture
def fake():
    with FakeDrive() as server:
        yield server
        assert not server.server_errors, server.server_errors


def _folder(fake: FakeDrive, title: str) -> str:
    with fake.lock:
        (found,) = [f.id for f in fake.files.values() if f.title == title and f.mime_type.endswith("folder")]
    return found


def _titles_per_folder(fake: FakeDrive) -> Counter:
    with fake.lock:
        return Counter((tuple(f.parents), f.title) for f in fake.files.values() if not f.trashed)


def test_kill_fresh_vm_identical_with_every_drive_behaviour_on(fake: FakeDrive, tiny_mnist: Path,
                                                                tmp_path: Path) -> None:
    extra = ["--epochs", "20", "--checkpoint-steps", "10", "--log-every", "1"]
    ref_log = tmp_path / "reference.log"
    with ref_log.open("w") as log_file:  # the uninterrupted local run trains at the same time as the Drive one
        reference = subprocess.Popen(command() + _train_args(str(tmp_path / "local"), tiny_mnist, *extra),
                                     stdout=subprocess.DEVNULL, stderr=log_file, stdin=subprocess.DEVNULL, env=env())
    fake.max_page = 2
    fake.list_lag_s = LAG_S
    fake.inject("lost", count=2, match="DELETE", skip=1)  # prune deletes: applied, the answer lost
    fake.inject("lost", count=1, match="POST /drive/v2/files", skip=2)  # a folder create: applied, answer lost
    fake.inject("lost", count=1, match="upload_id=", skip=3)  # an upload chunk: stored, answer lost
    cache = tmp_path / "cache"
    args = _train_args("gdrive://root/runs/t", tiny_mnist, *extra, "--cache-dir", str(cache))
    s = store(fake)
    killed_at = kill_once_durable(fake, args, 30, tmp_path, settle_s=LAG_S * 2)  # then what it wrote is listed
    lost = [what for kind, _, what in fake.faults_fired if kind == "lost"]
    assert len(lost) >= 2, f"answers lost before the kill: {lost}"

    # The fresh VM meets older same-titled copies of the run's logs and of its lease (a lost create's twin, a
    # stale copy), and every file's first download arrives damaged.
    run_folder = _folder(fake, "t")
    fake.add_file("metrics.jsonl", b'{"step": 999, "stale": true}\n', run_folder, modified="2000-01-01T00:00:00.000Z")
    fake.add_file("sessions.jsonl", b"not json\n", run_folder, modified="2000-01-01T00:00:00.000Z")
    fake.add_file("lease.json", b'{"pid": 1, "host": "old-vm"}', run_folder, modified="2000-01-01T00:00:00.000Z")
    fake.corrupt_first_download = True
    fake.inject("lost", count=1, match="DELETE")  # and in the fresh VM's session too: a lost delete, two 503s
    fake.inject("503", count=2, match="upload_id=", skip=2)
    shutil.rmtree(cache)  # a fresh VM: nothing local survives
    final = run(args, **drive_env(fake))
    assert final.returncode == 0, final.stderr
    assert f"brought checkpoint step {killed_at} back" in final.stderr, final.stderr[-3000:]
    assert f"resuming from step {killed_at}" in final.stderr
    corrupted = [what for kind, _, what in fake.faults_fired if kind == "corrupt"]
    assert any(name.startswith("shard-") for name in corrupted) and "metrics.jsonl" in corrupted, corrupted
    (local,) = cache.iterdir()
    assert reference.wait(timeout=300) == 0, ref_log.read_text()[-3000:]
    assert final_fingerprint(local) == final_fingerprint(tmp_path / "local")
    assert records(local) == records(tmp_path / "local")
    time.sleep(LAG_S * 2)
    assert durable_steps(s, tmp_path)[-1] == 120
    with fake.lock:
        paged = sum("pageToken=" in target for _, target in fake.requests)
    twins = {key: n for key, n in _titles_per_folder(fake).items() if n > 1}
    assert twins == {}, f"same-titled files left on Drive: {twins}"
    mirrored = next(line for line in final.stderr.splitlines() if "mirrored to" in line)
    assert "call(s) retried after transient errors" in mirrored, mirrored  # the 503s at least
    print(f"killed at durable step {killed_at}; lost answers {lost}; {len(corrupted)} downloads damaged in transit; "
          f"{paged} follow-up pages listed; after the fresh VM: {mirrored}")
