"""A Drive run dir taken over by another machine mid-run (issue #15, item 4): the session stops at the next step
boundary with exit 75, and from the moment it notices the takeover its mirror uploads and deletes nothing more,
against the loopback Drive (tests/fakedrive/)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

from fakedrive import FakeDrive
from helpers import command, env

from resumable.errors import EXIT_RESUME

FOREIGN = {"pid": 4242, "host": "other-vm", "token": "other-token", "started": "now"}


def _lease(fake: FakeDrive):
    with fake.lock:
        return next(f for f in fake.files.values() if f.title == "lease.json")


def _upload_id(target: str) -> str | None:
    return target.split("upload_id=", 1)[1].split("&", 1)[0] if "upload_id=" in target else None


def _changes(requests: list[tuple[str, str]], since: int) -> list[tuple[str, str]]:
    """Requests after index ``since`` that change the remote: anything but a read, except the further chunks of an
    upload session that was already under way (a remote call in flight finishes; none starts)."""
    under_way = {_upload_id(target) for _, target in requests[:since]} - {None}
    return [(method, target) for method, target in requests[since:]
            if method != "GET" and not (_upload_id(target) in under_way and method == "PUT")]


def test_a_taken_over_lease_stops_the_session_and_its_mirror(tiny_mnist: Path, tmp_path: Path) -> None:
    # ~14 MB per checkpoint at 1 MB/s: the takeover lands mid-upload, many seconds before that upload could end,
    # while the heartbeat (0.2 s) notices it at once.
    with FakeDrive(bandwidth=1_000_000) as fake:
        args = ["--run-dir", "gdrive://root/runs/owned", "--data-dir", str(tiny_mnist), "--batch-size", "16",
                "--no-progress", "--no-download", "--epochs", "100000", "--checkpoint-steps", "3",
                "--drive-flush-timeout", "30s", "--cache-dir", str(tmp_path / "cache")]
        proc = subprocess.Popen(command() + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL,
                                env=env(RESUMABLE_DRIVE_ENDPOINT=fake.base_url, RESUMABLE_DRIVE_TOKEN="fake-token",
                                        RESUMABLE_RETRY_BASE_S="0.01", RESUMABLE_LEASE_HEARTBEAT_S="0.2"))
        try:
            deadline = time.monotonic() + 180  # a guard against a hung test, not a measurement
            while time.monotonic() < deadline and proc.poll() is None:
                with fake.lock:
                    sending = [n for n in fake.upload_bytes.values() if 256 * 1024 <= n < 2_000_000]
                if sending:  # a checkpoint's shard is going up: take the lease over now
                    break
                time.sleep(0.01)
            assert proc.poll() is None, "the run ended before its first large upload"
            lines: list[str] = []
            reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
            reader.start()
            foreign = json.dumps({**FOREIGN, "heartbeat": time.time()}).encode()
            taken_at = commits_before = None
            # The old owner's heartbeat reads the lease, then writes it: a takeover landing between the two is
            # overwritten (lease.py's read-then-write race, not the mirror's). Then the other machine writes it again,
            # and the takeover counts from its last write.
            while proc.poll() is None and not any("taken over by other-vm" in line for line in list(lines)):
                with fake.lock:
                    lease = _lease(fake)
                    if lease.content != foreign:
                        lease.content = foreign
                        taken_at, commits_before = len(fake.requests), len(fake.commits)
                time.sleep(0.01)
            proc.wait(timeout=180)
            reader.join(timeout=10)
            stderr = "".join(lines)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert not fake.server_errors, fake.server_errors
        with fake.lock:
            requests = list(fake.requests)
            after = fake.commits[commits_before:]
            lease_now = json.loads(_lease(fake).content)
        print(f"requests after the takeover: {len(requests) - taken_at}; uploads completed after it: "
              f"{[title for _, title, _ in after]}")
        assert proc.returncode == EXIT_RESUME, stderr[-3000:]
        assert "was taken over by other-vm (process 4242)" in stderr, stderr[-3000:]
        assert "nothing more was written" in stderr and f"(exit code {EXIT_RESUME})" in stderr
        changes = _changes(requests, taken_at)
        assert changes == [], f"the remote was changed after the takeover: {changes[:10]}"
        assert "manifest.json" not in [title for _, title, _ in after], "no checkpoint became durable after it"
        assert "not uploading to Google Drive gdrive://root/runs/owned: the lease" in stderr, stderr[-3000:]
        assert lease_now["token"] == "other-token", "the new owner's lease is left as it is"


def test_a_mirror_whose_lease_is_lost_uploads_and_deletes_nothing(tmp_path: Path) -> None:
    from test_drive import _local_checkpoints, store

    from resumable.storage.tiered import Mirror, durable_steps

    with FakeDrive() as fake:
        s = store(fake)
        local = _local_checkpoints(tmp_path / "run", [1])
        owner: list[str] = []
        said: list[str] = []
        mirror = Mirror(local, s, tmp_path / "run", said.append, lost=lambda: owner[0] if owner else None)
        mirror.submit(1)
        assert mirror.flush(30) == [] and durable_steps(s, tmp_path) == [1]
        owner.append("the lease was taken over by other-vm")
        _local_checkpoints(tmp_path / "run", [2])
        local.delete(local.root / "step-000000001")  # retention dropped step 1: a prune would delete it remotely
        with fake.lock:
            before = len(fake.requests)
        mirror.submit(2)
        assert mirror.flush(30) == [2], "step 2 stays local"
        mirror.close()
        with fake.lock:
            changes = _changes(list(fake.requests), before)
        assert changes == [], changes
        assert durable_steps(s, tmp_path) == [1], "step 1 is not pruned, step 2 not uploaded"
        assert mirror.stopped_by == "the lease was taken over by other-vm"
        assert any("stopped mirroring" in line and "other-vm" in line for line in said), said
