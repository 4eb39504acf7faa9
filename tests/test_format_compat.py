"""Checkpoints of format 2 (one ``state.pt``, written by earlier versions) still resume, inspect, verify and
export; a run that resumes from one continues in format 3 (issue #11)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import policies

from resumable import Run
from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.checkpoint import format as fmt
from resumable.checkpoint.manifest import seal
from resumable.checkpoint.sharded import META
from resumable.checkpoint.state_format import TorchFile
from resumable.cli import main
from resumable.tools.export import export_model


def _train(run_dir: Path, **options) -> Run:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6), torch.randint(0, 3, (64,)))
    run = Run(run_dir, model=model, optimizer=optimizer, data=data, batch_size=8, epochs=2,
              **policies(progress=False, checkpoint_steps=3, checkpoint_every=None, **options))
    for _, _, (x, y) in run:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return run


def _as_format_2(run_dir: Path) -> None:
    """Make every checkpoint of ``run_dir`` exactly what format 2 wrote: its manifest without the fields format
    3 added, resealed."""
    for info in CheckpointManager(checkpoints_dir(run_dir)).inspect():
        body = {k: v for k, v in info.manifest.items() if k not in ("fingerprint_version", "trainable", "frozen")}
        fmt.write_json_atomic(info.path / fmt.MANIFEST, seal({**body, "format_version": 2}))


@pytest.fixture()
def old_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    with monkeypatch.context() as patch:
        patch.setattr("resumable.engine.session.training_session.ShardedFormat", lambda *a, **k: TorchFile())
        _train(tmp_path / "old", max_steps=5)
    _as_format_2(tmp_path / "old")
    infos = CheckpointManager(checkpoints_dir(tmp_path / "old")).inspect()
    assert infos and all(list(i.manifest["files"]) == [fmt.PAYLOAD] and i.format_version == 2 for i in infos)
    return tmp_path / "old"


def test_a_format_2_run_resumes_into_format_3_and_equals_the_uninterrupted_run(old_run: Path,
                                                                                tmp_path: Path) -> None:
    _train(tmp_path / "reference")
    resumed = _train(old_run)
    assert resumed.resumed_from == 5
    manager = CheckpointManager(checkpoints_dir(old_run))
    newest = manager.latest_valid()[0]
    assert META in newest.manifest["files"] and newest.format_version == fmt.FORMAT_VERSION
    reference = CheckpointManager(checkpoints_dir(tmp_path / "reference")).latest_valid()[0]
    assert newest.fingerprint == reference.fingerprint


def test_inspect_verify_and_export_read_both_formats(old_run: Path, tmp_path: Path) -> None:
    _train(old_run, max_steps=9, keep=10)  # adds format 3 checkpoints beside the format 2 ones
    runner = CliRunner()
    listing = json.loads(runner.invoke(main, ["inspect", "--json", str(old_run)]).output)
    versions = {c["step"]: c["format_version"] for c in listing["checkpoints"]}
    assert 2 in versions.values() and fmt.FORMAT_VERSION in versions.values(), versions
    assert all(c["valid"] for c in listing["checkpoints"])
    verified = runner.invoke(main, ["verify", str(old_run)])
    assert verified.exit_code == 0, verified.output
    manager = CheckpointManager(checkpoints_dir(old_run))
    for info in manager.inspect():
        payload = manager.load(info)
        assert set(payload["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    _, out = export_model(old_run, tmp_path / "model.pt")
    exported = torch.load(out, weights_only=True)
    newest = manager.load(manager.latest_valid()[0])
    assert all(torch.equal(exported[k], newest["model"][k]) for k in exported)
