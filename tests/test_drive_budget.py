"""Time to durable counts in the session budget: with a gdrive:// run dir the last checkpoint must reach Drive
before --time-limit, not only the local disk (Budget.durable_s, storage/pace.py), against a throttled loopback
Drive."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from fakedrive import FakeDrive
from helpers import command, env

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.engine.loop.preemption import Budget
from resumable.errors import EXIT_RESUME
from resumable.storage.pace import UploadPace

LIMIT_S = 30.0  # start-up on two busy cores (parallel test workers) may take 10 s of it

def test_budget_reserves_the_upload_after_the_final_save() -> None:
    ticks = iter([0.0, 4.0, 5.0])
    pace = UploadPace(clock=lambda: next(ticks))
    budget = Budget(100.0, start=0.0, margin=1.0, floor_s=0.0, durable_s=pace.durable_s)
    assert budget.fits(1.0, 2.0, now=96.5), "nothing measured yet: only the step and the save are reserved"
    pace.begin(8_000_000)
    pace.sent(8_000_000)
    pace.end()  # 2 MB/s
    assert pace.durable_s() == 4.0
    assert not budget.fits(1.0, 2.0, now=96.5) and budget.reserved == (2.0, 4.0)
    assert budget.fits(1.0, 2.0, now=92.5)
    # a checkpoint due at this boundary uploads before the final one: both are reserved, so this save is made
    # the final one instead of pushing it past the deadline
    assert not budget.fits(1.0, 2.0, now=92.5, saves=2) and budget.reserved == (2.0, 8.0)
    assert budget.fits(1.0, 2.0, now=88.5, saves=2)
    pace.begin(8_000_000)
    pace.sent(2_000_000)  # an upload in flight is finished first: its 6 MB left, then the final checkpoint's 8
    assert pace.durable_s() == 7.0 and pace.durable_s(2) == 11.0

def test_the_last_checkpoint_is_on_drive_before_the_time_limit(tiny_mnist: Path, tmp_path: Path) -> None:
    # ~14 MB a checkpoint at 8 MB/s: each upload takes ~2 s, far longer than the local save (~0.1 s).
    with FakeDrive(bandwidth=8_000_000) as fake:
        cache = tmp_path / "cache"
        args = ["--run-dir", "gdrive://root/runs/budget", "--data-dir", str(tiny_mnist), "--batch-size", "16",
                "--no-progress", "--no-download", "--epochs", "100000", "--checkpoint-every", "3s",
                "--time-limit", f"{LIMIT_S:.0f}s", "--cache-dir", str(cache)]

        started = time.time()  # the process starts after this, so its own deadline is no earlier than ours
        done = subprocess.run(command() + args, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                              env=env(RESUMABLE_DRIVE_ENDPOINT=fake.base_url, RESUMABLE_DRIVE_TOKEN="fake-token",
                                      RESUMABLE_RETRY_BASE_S="0.01"))
        assert not fake.server_errors, fake.server_errors
        assert done.returncode == EXIT_RESUME, done.stderr[-3000:]
        (local,) = cache.iterdir()
        newest = CheckpointManager(checkpoints_dir(local)).latest_valid()[0].step
        with fake.lock:
            folders = {f.id: f.title for f in fake.files.values()}
            manifests = [(at, folders.get(fake.files[file_id].parents[0]) if file_id in fake.files else None)
                         for at, title, file_id in fake.commits if title == "manifest.json"]
        print("manifests on Drive at (s from the start):", [(round(at - started, 1), f) for at, f in manifests])
        # Checkpoints (one each epoch of 6 steps, and every 3 s) come much faster than one uploads (~2 s), yet
        # they become durable during the run, one upload after the other: local retention keeps the one in flight.
        final_commit = (checkpoints_dir(local) / f"step-{newest:09d}" / "manifest.json").stat().st_mtime
        during = [at for at, _ in manifests if at < final_commit]
        assert len(during) >= 2, f"only {len(during)} checkpoint(s) reached Drive before the final one was saved"
        (newest_at,) = [at for at, folder in manifests if folder == f"step-{newest:09d}"]
        late = newest_at - started - LIMIT_S
        assert late <= 0, f"the newest checkpoint reached Drive {late:.1f} s after the limit\n{done.stderr[-3000:]}"
        assert "stopped early (time limit)" in done.stderr
        assert f"newest checkpoint step {newest} durable on Google Drive" in done.stderr
        assert "s before the time limit (final save" in done.stderr, done.stderr[-3000:]
        print(next(line for line in done.stderr.splitlines() if "before the time limit" in line))
