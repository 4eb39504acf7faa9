"""Cross-version resume: a checkpoint written by an earlier version of this project (a committed fixture, made by
tests/compat_train.py) resumes with the current code and ends where an uninterrupted run of the current code
ends; a checkpoint from another torch major.minor (compat-0.1.0-torch2.13: torch 2.13.0) resumes with a warning
naming both versions and takes the same next steps; and a Trainer checkpoint written by the previous transformers
major on the previous torch minor (hf-transformers4.57-torch2.13) resumes with the one-line warning to the same
next steps. The fixtures were made once in a scratch environment (their made-by.json says with what); tests never
download."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compat_train import train
from helpers import env, final_fingerprint, records

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
        _same_next_steps(run_dir, reference)
        return
    if not _same_cpu_kernels(fixture, tmp_path / "here"):  # another kind of CPU made it: no identity promised
        return
    assert final_fingerprint(run_dir) == final_fingerprint(reference)
    assert records(run_dir) == records(reference)


def _same_next_steps(run_dir: Path, reference: Path) -> None:
    """A run resumed on another torch takes the same next steps as this torch's uninterrupted run: the same records
    (steps, epochs, keys) with values equal to float32 rounding, and final weights as close."""
    mine, theirs = records(run_dir), records(reference)
    assert [sorted(r) for r in mine] == [sorted(r) for r in theirs]
    for a, b in zip(mine, theirs, strict=True):
        assert (a["step"], a.get("epoch")) == (b["step"], b.get("epoch"))
        for key in ("loss", "train_loss", "lr"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    weights = [_tensors(CheckpointManager(checkpoints_dir(d)).latest_valid()[0].path) for d in (run_dir, reference)]
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        assert torch.allclose(tensor.double(), weights[1][name].double(), rtol=1e-5, atol=1e-7), name


def _tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    found: dict[str, torch.Tensor] = {}
    for path in sorted(step_dir.glob("*.safetensors")):
        found.update({k: v for k, v in load_file(path).items() if k.startswith(("/model/", "/optimizer/"))})
    return found


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


HF_FIXTURE = Path(__file__).parent / "fixtures" / "hf-transformers4.57-torch2.13"


def _trainer(output_dir: Path, result: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(Path(__file__).with_name("hf_train.py")), str(output_dir), "--max-steps",
                           "10", "--save-steps", "5", "--result", str(result)], capture_output=True, text=True,
                          timeout=300, env=env(), stdin=subprocess.DEVNULL)


def test_a_trainer_checkpoint_of_the_previous_transformers_major_and_torch_minor_takes_the_same_next_steps(
        tmp_path: Path) -> None:
    # The fixture: checkpoint-5 of `tests/hf_train.py OUT --max-steps 10 --save-steps 5`, written through
    # ResumableCallback by transformers 4.57.6 on torch 2.13.0 (made-by.json); this session runs today's versions.
    pytest.importorskip("transformers")
    made_by = json.loads((HF_FIXTURE / "made-by.json").read_text())
    output_dir = tmp_path / "out"
    shutil.copytree(HF_FIXTURE / "checkpoint-5", output_dir / "checkpoint-5")
    resumed = _trainer(output_dir, tmp_path / "resumed.json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"RESUME-FROM {output_dir / 'checkpoint-5'}" in resumed.stdout
    import transformers
    if version_difference(made_by["torch"]) is not None and made_by["transformers"][0] != transformers.__version__[0]:
        line = (f"written with torch {made_by['torch']} and transformers {made_by['transformers']} and this session "
                f"runs torch {torch.__version__} and transformers {transformers.__version__}: it resumes")
        assert line in resumed.stderr
    reference = _trainer(tmp_path / "reference", tmp_path / "reference.json")
    assert reference.returncode == 0, reference.stderr[-3000:]
    mine, theirs = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("resumed", "reference"))
    assert mine["global_step"] == theirs["global_step"] == 10
    assert mine["steps"].keys() == theirs["steps"].keys() and len(mine["steps"]) == 10
    for step, logged in theirs["steps"].items():  # steps 1-5 from the old versions' log, 6-10 trained here
        assert mine["steps"][step]["learning_rate"] == pytest.approx(logged["learning_rate"], rel=1e-9), step
        assert mine["steps"][step]["loss"] == pytest.approx(logged["loss"], rel=1e-4), step
