"""resumable export: the chosen checkpoint's model weights as a plain, weights_only-loadable state_dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import replace_bytes, shards
from torch import nn

from resumable.checkpoint import CheckpointManager, checkpoints_dir, fingerprint
from resumable.checkpoint.sharded import META
from resumable.tools.export import ExportError, checkpoint_to_export, export_command, export_model


def _save(root: Path, step: int, model: dict[str, Any], **meta: Any) -> None:
    manager = CheckpointManager(checkpoints_dir(root))
    manager.save(step, {"model": model, "optimizer": {}, "train_state": {"step": step}},
                 {"fingerprint": fingerprint(model, {}), **meta})


def _local_checkpoints(root: Path, steps: list[int], accs: list[float | None] | None = None) -> None:
    for index, step in enumerate(steps):
        acc = accs[index] if accs else None
        metrics = {"test_acc": acc} if acc is not None else {}
        _save(root, step, {"w": torch.full((64, 64), float(step))}, epoch=index, metrics=metrics)


def invoke(*args: str):
    return CliRunner().invoke(export_command, list(args), catch_exceptions=False)


def test_newest_export_loads_into_a_plain_module(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "out" / "model.pt"
    _local_checkpoints(run_dir, [1, 2])
    trained = nn.Linear(3, 2)
    wrapped = {f"_orig_mod.{k}": v for k, v in trained.state_dict().items()}  # as torch.compile saves it
    _save(run_dir, 3, wrapped, epoch=1, metrics={"test_acc": 0.5})

    result = invoke(str(run_dir), "--out", str(out))

    assert result.exit_code == 0, result.output
    assert result.output == (f"exported model weights of step 3 (epoch 1, test_acc 0.5000) from "
                             f"{checkpoints_dir(run_dir) / 'step-000000003'} to {out}\n")
    state = torch.load(out, weights_only=True)
    assert list(state) == ["weight", "bias"]
    fresh = nn.Linear(3, 2)
    fresh.load_state_dict(state)  # strict: the prefix is gone
    for name, tensor in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor)
    assert [p.name for p in out.parent.iterdir()] == ["model.pt"]  # no temp file left


def test_newest_weights_and_ddp_prefix(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _local_checkpoints(run_dir, [1, 2, 3])
    _save(run_dir, 4, {"module._orig_mod.w": torch.full((4,), 4.0)})
    info, out = export_model(run_dir, tmp_path / "model.pt")
    assert info.step == 4
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.full((4,), 4.0))


def test_best_picks_highest_test_acc_not_newest(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "model.pt"
    _local_checkpoints(run_dir, [1, 2, 3, 4], accs=[0.5, 0.9, 0.9, 0.7])  # tie 2/3: the newer wins

    result = invoke(str(run_dir), "--out", str(out), "--best")

    assert result.exit_code == 0, result.output
    assert "step 3 (epoch 2, test_acc 0.9000)" in result.output
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.full((64, 64), 3.0))
    assert checkpoint_to_export(run_dir, best=False).step == 4


def test_corrupt_newest_is_skipped(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "model.pt"
    _local_checkpoints(run_dir, [1, 2], accs=[0.3, 0.8])
    payload = shards(checkpoints_dir(run_dir) / "step-000000002")[0]
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the sha256 catches it
    replace_bytes(payload, bytes(data))

    for extra in ([], ["--best"]):
        result = invoke(str(run_dir), "--out", str(out), *extra)
        assert result.exit_code == 0, result.output
        assert "step 1 " in result.output
        assert torch.equal(torch.load(out, weights_only=True)["w"], torch.full((64, 64), 1.0))


def test_no_checkpoints_exit_2_one_line(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "model.pt"
    run_dir.mkdir()
    for extra in ([], ["--best"]):
        result = invoke(str(run_dir), "--out", str(out), *extra)
        assert result.exit_code == 2
        assert result.output.startswith("error: no checkpoints in ") and result.output.count("\n") == 1
        assert str(run_dir) in result.output
    assert not out.exists()


def test_no_valid_checkpoint_and_best_without_test_acc(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _local_checkpoints(run_dir, [1])
    with pytest.raises(ExportError, match="--best: no valid checkpoint .* records test_acc"):
        checkpoint_to_export(run_dir, best=True)
    (checkpoints_dir(run_dir) / "step-000000001" / META).write_bytes(b"garbage")
    for best in (False, True):
        with pytest.raises(ExportError, match=r"no valid checkpoint in .*\(1 invalid\)"):
            checkpoint_to_export(run_dir, best=best)


def test_out_is_a_directory_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _local_checkpoints(run_dir, [1])
    result = invoke(str(run_dir), "--out", str(tmp_path))
    assert result.exit_code == 2
    assert result.output.startswith("error: --out ") and "is a directory" in result.output
