from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner
from helpers import replace_bytes, shards
from test_resume import train

from resumable.checkpoint import checkpoints_dir
from resumable.cli import main


def test_inspect_and_verify(tiny_mnist: Path, tmp_path: Path) -> None:
    import json

    train(tmp_path, tiny_mnist, "--max-steps", "8", "--checkpoint-steps", "4")
    runner = CliRunner()
    data = json.loads(runner.invoke(main, ["inspect", "--json", str(tmp_path)]).output)
    steps = [c["step"] for c in data["checkpoints"]]
    assert steps == [4, 6, 8]
    assert all({"step", "epoch", "valid", "fingerprint", "path"} <= set(c) for c in data["checkpoints"])
    assert data["latest_valid"]["step"] == 8 and len(data["latest_valid"]["fingerprint"]) == 64
    text = runner.invoke(main, ["inspect", str(tmp_path)]).output
    assert "latest valid" in text and "valid" in text
    assert runner.invoke(main, ["verify", str(tmp_path)]).exit_code == 0

    payload = shards(checkpoints_dir(tmp_path) / "step-000000008")[0]
    data_bytes = bytearray(payload.read_bytes())
    data_bytes[200] ^= 0xFF
    replace_bytes(payload, bytes(data_bytes))  # a new file: the shard may be linked into step 6 too
    data = json.loads(runner.invoke(main, ["inspect", "--json", str(tmp_path)]).output)
    assert data["latest_valid"]["step"] == 6
    assert data["checkpoints"][-1]["valid"] is False and "sha256" in data["checkpoints"][-1]["reason"]
    result = runner.invoke(main, ["verify", str(tmp_path)])
    assert result.exit_code == 1 and "INVALID" in result.output


def test_inspect_empty(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 0 and "no checkpoints" in result.output
    assert CliRunner().invoke(main, ["verify", str(tmp_path)]).exit_code == 2
