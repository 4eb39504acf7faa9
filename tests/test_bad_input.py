"""Checkpoints that do not fit: each is a one-line error naming the problem, exit 2, run dir untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import rewrite_payload
from test_resume import _listing, train

from resumable.checkpoint import checkpoints_dir
from resumable.checkpoint import format as fmt
from resumable.cli import train_command


def _rewrite_payload(step_dir: Path, change) -> None:
    """Change the payload and re-sign it, so only its content (not its integrity) is wrong."""
    rewrite_payload(step_dir, change)


def _extra_layer(payload) -> None:
    payload["model"]["fc3.weight"] = torch.zeros(10, 10)


def _other_shape(payload) -> None:
    payload["model"]["fc2.weight"] = torch.zeros(5, 128)


def _future_version(step_dir: Path) -> None:
    manifest = json.loads((step_dir / fmt.MANIFEST).read_text())
    manifest["format_version"] = fmt.FORMAT_VERSION + 1
    (step_dir / fmt.MANIFEST).write_text(json.dumps(manifest))


def _garbage_manifest(step_dir: Path) -> None:
    (step_dir / fmt.MANIFEST).write_text("{ this is not json")


@pytest.mark.parametrize("damage, expected", [
    (lambda d: _rewrite_payload(d, _extra_layer), "does not fit this model"),
    (lambda d: _rewrite_payload(d, _other_shape), "does not fit this model"),
    (_future_version, "newer than this resumable understands"),
    (_garbage_manifest, "manifest.json is unreadable"),
], ids=["another-model-keys", "another-model-shapes", "future-format", "garbage-manifest"])
def test_bad_checkpoint_is_one_line_exit_2_and_untouched(tiny_mnist: Path, tmp_path: Path, damage,
                                                         expected: str) -> None:
    train(tmp_path, tiny_mnist, "--max-steps", "3")
    damage(checkpoints_dir(tmp_path) / "step-000000003")
    before = _listing(tmp_path)
    result = CliRunner().invoke(train_command, ["--run-dir", str(tmp_path), "--data-dir", str(tiny_mnist),
                                                "--batch-size", "16", "--no-progress", "--no-download"])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0] and ("--fresh --overwrite" in errors[0])
    assert _listing(tmp_path) == before, "a refused start must not modify the run dir"


@pytest.mark.parametrize("url", ["gdrive://", "gdrive://root/../x", "gdrive://root/it's"])
def test_bad_drive_urls_exit_2(tmp_path: Path, url: str) -> None:
    result = CliRunner().invoke(train_command, ["--run-dir", url, "--data-dir", str(tmp_path), "--no-progress"])
    assert result.exit_code == 2 and "gdrive" in result.output
