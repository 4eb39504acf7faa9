"""Cross-version resume: a checkpoint written by an earlier version of this project (a committed fixture, made by
tests/compat_train.py) resumes with the current code and ends where an uninterrupted run of the current code
ends; a checkpoint from another torch major.minor resumes with a warning naming both versions."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from compat_train import train
from helpers import final_fingerprint, records

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.checkpoint import format as fmt
from resumable.checkpoint.manifest import seal
from resumable.engine.state.determinism import version_difference

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("compat-*"))


def _resume(run_dir: Path) -> str:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        run = train(run_dir)
    assert run.finished and run.resumed_from == 5, stderr.getvalue()
    return stderr.getvalue()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("compat") / "reference"
    assert train(run_dir).finished
    return run_dir


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.name for f in FIXTURES])
def test_a_checkpoint_of_an_earlier_version_resumes_to_the_same_end(fixture: Path, reference: Path,
                                                                    tmp_path: Path) -> None:
    made_by = json.loads((fixture / "made-by.json").read_text())
    run_dir = shutil.copytree(fixture, tmp_path / "run")
    log = _resume(run_dir)
    assert "resuming from step 5" in log and "resume verified in" in log
    if version_difference(made_by["torch"]) is not None:  # another torch: it resumes, identity is not promised
        assert f"written with torch {made_by['torch']}" in log
        return
    if not _same_cpu_kernels(fixture, tmp_path / "here"):  # another kind of CPU made it: no identity promised
        return
    assert final_fingerprint(run_dir) == final_fingerprint(reference)
    assert records(run_dir) == records(reference)


def _same_cpu_kernels(fixture: Path, scratch: Path) -> bool:
    """Whether this machine computes what the machine that made ``fixture`` computed: the CPU recorded with it, or
    (a fixture made before it was recorded) its steps trained here give its checkpoint, byte for byte. CPU kernels
    round differently per instruction set (AVX2, AVX512...), and bit-identity is promised on the same device only."""
    manifest = CheckpointManager(checkpoints_dir(fixture)).latest_valid()[0].manifest
    recorded = manifest.get("cpu_capability")
    if recorded is not None:
        return recorded == torch.backends.cpu.get_cpu_capability()
    train(scratch, max_steps=manifest["step"])
    return final_fingerprint(scratch) == manifest["fingerprint"]


def test_a_checkpoint_of_another_torch_version_resumes_with_a_warning(tmp_path: Path) -> None:
    run_dir = shutil.copytree(FIXTURES[-1], tmp_path / "run")
    for info in CheckpointManager(checkpoints_dir(run_dir)).inspect():
        body = {k: v for k, v in info.manifest.items() if k != "manifest_sha256"}
        fmt.write_json_atomic(info.path / fmt.MANIFEST, seal({**body, "torch_version": "1.13.1+cu117"}))
    log = _resume(run_dir)
    assert (f"this checkpoint was written with torch 1.13.1+cu117 and this session runs torch {torch.__version__}: "
            f"it resumes, but bit-identity") in log


def test_version_difference_compares_major_and_minor_only() -> None:
    assert version_difference("2.14.0", "2.14.1+cu130") is None
    assert version_difference("2.13.1", "2.14.1") is not None
    assert version_difference(None, "2.14.1") is None and version_difference("nightly", "2.14.1") is None
