"""SIGKILL inside a multi-shard checkpoint write: the shards written so far never count, and the resumed run
equals an uninterrupted one (issue #11)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from helpers import command, env, final_fingerprint, records, run

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.checkpoint import format as fmt
from resumable.checkpoint.layout import STEPS
from resumable.faults import Faults

ARGS = ["--max-steps", "14", "--batch-size", "16", "--checkpoint-steps", "5", "--log-every", "1", "--no-progress",
        "--no-download", "--shard-size", "512KB"]


def _unfinished(run_dir: Path) -> list[Path]:
    """Step dirs with shards on disk and no manifest yet."""
    found = []
    for _, path in CheckpointManager(checkpoints_dir(run_dir)).step_dirs():
        try:
            shards = [p for p in path.iterdir() if p.name.endswith(".safetensors")]
        except OSError:
            continue
        if len(shards) >= 2 and not (path / fmt.MANIFEST).exists():
            found.append(path)
    return found


def test_a_kill_inside_a_multi_shard_write_never_counts(tiny_mnist: Path, tmp_path: Path) -> None:
    reference, ref_log = tmp_path / "reference", tmp_path / "reference.log"
    with ref_log.open("w") as log_file:  # the uninterrupted run trains at the same time as the one killed below
        uninterrupted = subprocess.Popen(command() + ["--run-dir", str(reference), "--data-dir", str(tiny_mnist),
                                                      *ARGS], stdout=subprocess.DEVNULL, stderr=log_file,
                                         stdin=subprocess.DEVNULL, env=env())

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(command() + ["--run-dir", str(run_dir), "--data-dir", str(tiny_mnist), *ARGS],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            env=env(**Faults(shard_delay_s=0.1).to_env()))
    deadline = time.monotonic() + 180
    # The first checkpoint (step 5) is committed, and the next one is half-way through its shards.
    while time.monotonic() < deadline and proc.poll() is None:
        valid = CheckpointManager(checkpoints_dir(run_dir)).latest_valid()[0]
        if valid is not None and _unfinished(run_dir):
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = _unfinished(run_dir)
    assert partial, "killed inside a multi-shard write"
    manager = CheckpointManager(checkpoints_dir(run_dir))
    latest, _ = manager.latest_valid()
    partial_step = STEPS.parse(partial[0].name)
    assert latest is not None and latest.step < partial_step, "a step dir without its manifest is no checkpoint"

    resumed = run(["--run-dir", str(run_dir), "--data-dir", str(tiny_mnist), *ARGS])
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from step {latest.step}" in resumed.stderr
    assert uninterrupted.wait(timeout=300) == 0, ref_log.read_text()[-3000:]
    newest = CheckpointManager(checkpoints_dir(reference)).latest_valid()[0]
    assert sum(name.startswith("shard-") for name in newest.manifest["files"]) >= 4, "the state spans several shards"
    assert (final_fingerprint(run_dir), records(run_dir)) == (final_fingerprint(reference), records(reference))
    assert not _unfinished(run_dir)
