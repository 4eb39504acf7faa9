"""Resumption at every kind of position, fallback past corrupt checkpoints, start-up rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import final_fingerprint, records, replace_bytes, shards

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.cli import train_command

BATCHES = 6  # tiny_mnist: 96 images / batch 16
TOTAL = 3 * BATCHES


def train(run_dir: Path, data: Path, *args: str) -> str:
    result = CliRunner().invoke(
        train_command, ["--run-dir", str(run_dir), "--data-dir", str(data), "--batch-size", "16",
                        "--epochs", "3", "--log-every", "1", "--no-progress", "--no-download", *args],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def reference(tiny_mnist: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    run_dir = tmp_path_factory.mktemp("reference")
    train(run_dir, tiny_mnist, "--max-steps", str(TOTAL), "--lr-schedule", "onecycle")
    return final_fingerprint(run_dir), records(run_dir)


@pytest.mark.parametrize("stop", [0, 3, BATCHES - 1, BATCHES, 2 * BATCHES - 1, TOTAL - 1],
                         ids=["step0", "mid-epoch", "last-batch", "epoch-boundary", "last-batch-2", "one-before-end"])
def test_resume_anywhere_is_bit_identical(tiny_mnist: Path, tmp_path: Path, reference, stop: int) -> None:
    train(tmp_path, tiny_mnist, "--max-steps", str(stop), "--lr-schedule", "onecycle")
    latest = CheckpointManager(checkpoints_dir(tmp_path)).latest_valid()[0]
    assert latest.step == stop
    output = train(tmp_path, tiny_mnist, "--max-steps", str(TOTAL))  # schedule inherited from the checkpoint
    assert f"resuming from step {stop}" in output
    assert (final_fingerprint(tmp_path), records(tmp_path)) == reference


def test_metrics_after_the_resumed_step_are_rolled_back(tiny_mnist: Path, tmp_path: Path, reference) -> None:
    train(tmp_path, tiny_mnist, "--max-steps", "4", "--lr-schedule", "onecycle")
    with open(tmp_path / "metrics.jsonl", "a") as f:  # what a killed session wrote after its checkpoint
        f.write(json.dumps({"step": 5, "epoch": 1, "loss": 9.9}) + "\n" + '{"step": 6, "ep')
    train(tmp_path, tiny_mnist, "--max-steps", str(TOTAL))
    assert records(tmp_path) == reference[1]


def _truncate(d: Path) -> None:
    shard = shards(d)[0]
    replace_bytes(shard, shard.read_bytes()[:1000])


def _flip(d: Path) -> None:
    shard = shards(d)[-1]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    replace_bytes(shard, bytes(data))


def _drop_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


@pytest.mark.parametrize("corrupt", [_truncate, _flip, _drop_manifest])
def test_corrupt_newest_checkpoint_falls_back_and_still_matches(tiny_mnist: Path, tmp_path: Path, reference,
                                                                corrupt) -> None:
    train(tmp_path, tiny_mnist, "--max-steps", "10", "--checkpoint-steps", "4", "--lr-schedule", "onecycle")
    manager = CheckpointManager(checkpoints_dir(tmp_path))
    assert [s for s, _ in manager.step_dirs()] == [6, 8, 10]  # --keep 3
    corrupt(manager.root / "step-000000010")
    output = train(tmp_path, tiny_mnist, "--max-steps", str(TOTAL))
    assert "resuming from step 8" in output
    if corrupt is not _drop_manifest:
        assert "skipping checkpoint step 10" in output
    assert (final_fingerprint(tmp_path), records(tmp_path)) == reference


def _listing(path: Path) -> dict[str, float]:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize("option, value, old", [("--lr", "0.01", "0.001"), ("--batch-size", "32", "16"),
                                                ("--seed", "2", "1"), ("--lr-schedule", "step", "'none'")])
def test_config_mismatch_exits_2_naming_the_field(tiny_mnist: Path, tmp_path: Path, option: str, value: str,
                                                  old: str) -> None:
    train(tmp_path, tiny_mnist, "--max-steps", "3")
    before = _listing(tmp_path)
    args = ["--run-dir", str(tmp_path), "--data-dir", str(tiny_mnist), "--no-progress", option, value]
    if option != "--batch-size":
        args += ["--batch-size", "16"]
    result = CliRunner().invoke(train_command, args)
    assert result.exit_code == 2
    field = option[2:].replace("-", "_")
    assert f"{field} differs" in result.output and old in result.output
    assert _listing(tmp_path) == before, "a refused start must not modify the run dir"


def test_other_dataset_is_refused(tiny_mnist: Path, tmp_path: Path) -> None:
    from conftest import make_tiny_mnist

    train(tmp_path / "run", tiny_mnist, "--max-steps", "3")
    other = make_tiny_mnist(tmp_path / "other", seed=5)
    result = CliRunner().invoke(train_command, ["--run-dir", str(tmp_path / "run"), "--data-dir", str(other),
                                                "--no-progress"])
    assert result.exit_code == 2 and "dataset differs" in result.output


def test_resume_without_checkpoint_exits_2(tiny_mnist: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(train_command, ["--run-dir", str(tmp_path / "empty"), "--data-dir",
                                                str(tiny_mnist), "--resume", "--no-progress"])
    assert result.exit_code == 2 and "--resume needs a valid checkpoint" in result.output
    assert not (tmp_path / "empty").exists()


def test_fresh_refuses_existing_checkpoints_unless_overwrite(tiny_mnist: Path, tmp_path: Path) -> None:
    train(tmp_path, tiny_mnist, "--max-steps", "3")
    before = _listing(tmp_path)
    result = CliRunner().invoke(train_command, ["--run-dir", str(tmp_path), "--data-dir", str(tiny_mnist),
                                                "--fresh", "--no-progress"])
    assert result.exit_code == 2 and "--overwrite" in result.output
    assert _listing(tmp_path) == before
    output = train(tmp_path, tiny_mnist, "--max-steps", "2", "--fresh", "--overwrite")
    assert "resuming" not in output
    assert [s for s, _ in CheckpointManager(checkpoints_dir(tmp_path)).step_dirs()] == [2]


def test_only_invalid_checkpoints_refuses_to_start_over(tiny_mnist: Path, tmp_path: Path) -> None:
    train(tmp_path, tiny_mnist, "--max-steps", "3")
    _flip(checkpoints_dir(tmp_path) / "step-000000003")
    result = CliRunner().invoke(train_command, ["--run-dir", str(tmp_path), "--data-dir", str(tiny_mnist),
                                                "--no-progress"])
    assert result.exit_code == 2 and "none is valid" in result.output


def test_thread_count_is_restored(tiny_mnist: Path, tmp_path: Path) -> None:
    original = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        train(tmp_path, tiny_mnist, "--max-steps", "2")
        torch.set_num_threads(2)
        output = train(tmp_path, tiny_mnist, "--max-steps", "4")
        assert "setting torch threads to 1" in output and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(original)


def test_completed_run_says_so(tiny_mnist: Path, tmp_path: Path) -> None:
    train(tmp_path, tiny_mnist, "--max-steps", "2")
    assert "already complete" in train(tmp_path, tiny_mnist)


def test_retention_keeps_newest_and_best(tiny_mnist: Path, tmp_path: Path) -> None:
    train(tmp_path, tiny_mnist, "--checkpoint-steps", "1", "--keep", "2")
    manager = CheckpointManager(checkpoints_dir(tmp_path))
    infos = manager.inspect()
    steps = [i.step for i in infos]
    best = max((i for i in infos if i.test_acc is not None), key=lambda i: (i.test_acc, -i.step))
    assert steps[-2:] == [TOTAL - 1, TOTAL] and set(steps) <= {best.step, TOTAL - 1, TOTAL}
    assert all(i.valid for i in infos)


def test_malicious_newest_payload_is_refused_and_skipped(tiny_mnist: Path, tmp_path: Path) -> None:
    from test_checkpoint import Evil

    from resumable.checkpoint import format as fmt
    from resumable.checkpoint.manifest import seal
    from resumable.checkpoint.sharded import META

    train(tmp_path, tiny_mnist, "--max-steps", "4", "--checkpoint-steps", "2")
    newest = checkpoints_dir(tmp_path) / "step-000000004"
    Evil.marker = tmp_path / "pwned"
    # meta.pt is the file torch.load reads; a consistent manifest: only weights_only stops it
    entry = fmt.write_payload(newest, {"model": Evil()}, META)
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"][META] = entry
    (newest / "manifest.json").write_text(json.dumps(seal(manifest)))  # re-sealed: only the payload is wrong
    output = train(tmp_path, tiny_mnist, "--max-steps", "6")
    assert "skipping checkpoint step 4" in output and "refused" in output
    assert "resuming from step 2" in output
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_amp_resume_is_bit_identical_and_saves_the_scaler(tiny_mnist: Path, tmp_path: Path, amp: str) -> None:
    """The CPU side of the AMP path (scripts/gpu_check.sh runs it on CUDA)."""
    train(tmp_path / "straight", tiny_mnist, "--max-steps", "6", "--amp", amp)  # fp16 on a CPU is slow: few steps
    train(tmp_path / "resumed", tiny_mnist, "--max-steps", "3", "--amp", amp)
    train(tmp_path / "resumed", tiny_mnist, "--max-steps", "6")  # --amp inherited from the checkpoint
    assert final_fingerprint(tmp_path / "straight") == final_fingerprint(tmp_path / "resumed")
    assert records(tmp_path / "straight") == records(tmp_path / "resumed")
    manager = CheckpointManager(checkpoints_dir(tmp_path / "resumed"))
    scaler = manager.load(manager.latest_valid()[0])["scaler"]
    assert (scaler is not None and scaler["scale"] > 0) if amp == "fp16" else scaler is None
