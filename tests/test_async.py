"""Asynchronous checkpointing: snapshot semantics, equivalence with sync saves, failure reporting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.checkpoint.snapshot import Snapshotter
from resumable.checkpoint.writer import CheckpointWriter, SaveFailed
from resumable.cli import train_command
from resumable.engine.state.keeper import StateKeeper
from resumable.engine.state.train_state import TrainState
from resumable.faults import NO_FAULTS, Faults


def _session(root: Path, asynchronous: bool = True, faults: Faults = NO_FAULTS):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    session = StateKeeper(CheckpointManager(root, faults=faults), {"model": model, "optimizer": optimizer},
                           TrainState(), meta={}, writer=CheckpointWriter(asynchronous=asynchronous))
    return session, model, optimizer


def test_checkpoint_holds_values_from_when_save_returned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug of pytorch#144657: CPU tensors saved by reference change if training goes on."""
    # the write happens well after save() returns
    session, model, optimizer = _session(tmp_path, faults=Faults(save_delay_s=0.5))
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_avg = optimizer.state[model[0].weight]["exp_avg"].clone()
    session.save("test")
    assert session.writer.busy, "save() must return before the checkpoint is written"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # mutate parameters and optimizer state in place right away
    optimizer.state[model[0].weight]["exp_avg"].mul_(3.0)
    session.close()
    payload = session.manager.load(session.manager.latest_valid()[0])
    for key, value in expected_model.items():
        assert torch.equal(payload["model"][key], value)
    assert torch.equal(payload["optimizer"]["state"][0]["exp_avg"], expected_avg)


def test_snapshot_copies_cpu_tensors_and_keeps_layout() -> None:
    weight = torch.randn(4, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    state = {"w": weight, "nested": [torch.arange(3), {"n": 7}], "t": (torch.ones(2),)}
    snap = Snapshotter()
    copy = snap.take(state)
    assert copy["w"].data_ptr() != weight.data_ptr() and torch.equal(copy["w"], weight)
    assert copy["w"].stride() == weight.stride(), "fused optimizers need the parameter's layout"
    assert copy["nested"][1] == {"n": 7} and isinstance(copy["t"], tuple)
    assert snap.bytes == weight.numel() * 4 + 3 * 8 + 2 * 4
    buffer = copy["w"]
    weight.add_(1)
    again = snap.take(state)
    assert again["w"].data_ptr() == buffer.data_ptr(), "buffers are reused between snapshots"
    assert torch.equal(again["w"], weight)


def _load_all(run_dir: Path) -> dict:
    manager = CheckpointManager(checkpoints_dir(run_dir))
    return {info.step: (info.fingerprint, manager.load(info)) for info in manager.inspect() if info.valid}


def _assert_same(a, b, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.stride() == b.stride(), path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}/{i}")
    elif path.endswith("elapsed_s"):
        return  # wall-clock time differs between any two runs
    else:
        assert a == b, path


def test_async_and_sync_checkpoints_have_identical_content(tiny_mnist: Path, tmp_path: Path) -> None:
    base = ["--data-dir", str(tiny_mnist), "--batch-size", "16", "--epochs", "2", "--checkpoint-steps", "4",
            "--keep", "10", "--no-progress", "--no-download"]
    for name, extra in (("sync", ["--sync-checkpoints"]), ("async", [])):
        result = CliRunner().invoke(train_command, ["--run-dir", str(tmp_path / name), *base, *extra])
        assert result.exit_code == 0, result.output
    sync, asynchronous = _load_all(tmp_path / "sync"), _load_all(tmp_path / "async")
    assert sorted(sync) == sorted(asynchronous) == [4, 6, 8, 12]
    for step in sync:
        assert sync[step][0] == asynchronous[step][0]
        _assert_same(sync[step][1], asynchronous[step][1], f"step {step}")


def test_failed_background_save_is_reported_and_previous_stays_newest(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    session, model, _ = _session(tmp_path)
    session.save("first", wait=True)
    original = CheckpointManager.commit

    def failing(self, step, files, meta, **options):  # the payload files are on disk by now: only the manifest fails
        assert (self.root / f"step-{step:09d}").is_dir()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CheckpointManager, "commit", failing)
    session.state.step = 5
    session.save("second")
    with pytest.raises(SaveFailed, match="step 5 failed: .*No space left"):
        session.close()
    monkeypatch.setattr(CheckpointManager, "commit", original)
    latest, skipped = session.manager.latest_valid()
    assert latest.step == 0 and skipped == [], "the failed save's unfinished step dir is removed, not left to count"
    assert not (session.manager.root / "step-000000005").exists()


def test_cli_reports_failed_saves_and_exits_75(tiny_mnist: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    original = CheckpointManager.commit  # what the engine calls once a save's files are written
    calls = []

    def flaky(self, step, files, meta, **options):
        calls.append(step)
        if len(calls) > 1:
            raise OSError(5, "Input/output error")
        return original(self, step, files, meta, **options)

    monkeypatch.setattr(CheckpointManager, "commit", flaky)
    result = CliRunner().invoke(train_command, ["--run-dir", str(tmp_path), "--data-dir", str(tiny_mnist),
                                                "--batch-size", "16", "--checkpoint-steps", "2", "--no-progress"])
    # Every save after the first fails, the last one too: the run ends early with its state not committed.
    assert result.exit_code == 75, result.output
    assert "Input/output error" in result.output and "newest valid checkpoint is still step 2" in result.output
    assert "stopped early (a checkpoint could not be written): the newest valid checkpoint is step 2" in result.output
    monkeypatch.setattr(CheckpointManager, "commit", original)
    assert CheckpointManager(checkpoints_dir(tmp_path)).latest_valid()[0].step == 2
