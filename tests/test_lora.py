"""LoRA (peft) on a tiny Hugging Face model built from a config: the frozen base is not stored, a killed run
resumes to the uninterrupted run's adapter and optimizer state, and a different base is refused (issue #11)."""

from __future__ import annotations

import importlib.util
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import env, records
from safetensors import safe_open

from resumable.checkpoint import CheckpointManager, checkpoints_dir

pytest.importorskip("peft")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "lora_example.py"
_spec = importlib.util.spec_from_file_location("lora_example", SCRIPT)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)
BASE_WEIGHT = "base_model.model.model.layers.1.mlp.down_proj.weight"


def _latest(run_dir: Path):
    return CheckpointManager(checkpoints_dir(run_dir)).latest_valid()[0]


def _stored_names(info) -> set[str]:
    names: set[str] = set()
    for name in info.manifest["files"]:
        if name.endswith(".safetensors"):
            with safe_open(str(info.path / name), "pt") as handle:
                names.update(handle.keys())
    return names


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("lora-reference")
    assert example.main(["--run-dir", str(run_dir)]) == 0
    return run_dir


def test_the_frozen_base_is_recorded_not_stored(reference: Path) -> None:
    info = _latest(reference)
    frozen = info.manifest["frozen"]
    assert BASE_WEIGHT in frozen and "base_model.model.model.embed_tokens.weight" in frozen
    assert all("lora_" not in name for name in frozen), "the adapters are trained: stored"
    stored = _stored_names(info)
    assert any("lora_A" in name for name in stored)
    assert not any("base_layer" in name or "embed_tokens" in name for name in stored), stored
    assert info.manifest["trainable"] and all("lora_" in name for name in info.manifest["trainable"])


def test_killed_and_resumed_lora_run_equals_the_uninterrupted_one(reference: Path, tmp_path: Path) -> None:
    # Session 1 stops at --max-steps 6, session 2 is killed with SIGKILL, session 3 finishes: two resumes.
    assert example.main(["--run-dir", str(tmp_path), "--max-steps", "6"]) == 0
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--run-dir", str(tmp_path), "--step-sleep", "0.3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env(),
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        latest = _latest(tmp_path)
        if latest is not None and latest.step >= 12:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _latest(tmp_path).step < 24, "killed before the end"
    assert example.main(["--run-dir", str(tmp_path)]) == 0
    assert _latest(tmp_path).fingerprint == _latest(reference).fingerprint, "adapter + optimizer state differ"
    assert records(tmp_path) == records(reference)


def test_a_different_base_is_refused_naming_the_weight(reference: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file() and p.suffix != ".lock"}
    assert example.main(["--run-dir", str(run_dir), "--epochs", "3", "--perturb-base"]) == 2
    error = capsys.readouterr().err
    assert f"the frozen tensor '{BASE_WEIGHT}' differs" in error and "nothing was changed" in error, error
    assert len(error.strip().splitlines()[-1]) > 0 and "Traceback" not in error
    after = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file() and p.suffix != ".lock"}
    assert {p: b for p, b in after.items() if p.name.endswith((".pt", ".safetensors", "manifest.json"))} == \
        {p: b for p, b in before.items() if p.name.endswith((".pt", ".safetensors", "manifest.json"))}


def test_changing_requires_grad_between_sessions_is_a_mismatch(reference: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    assert example.main(["--run-dir", str(run_dir), "--epochs", "3", "--train-head"]) == 2
    error = capsys.readouterr().err
    assert "requires_grad differs" in error and "now trainable: base_model.model.lm_head.weight" in error, error


def test_store_frozen_stores_the_base_too(tmp_path: Path) -> None:
    assert example.main(["--run-dir", str(tmp_path), "--max-steps", "4", "--store-frozen"]) == 0
    info = _latest(tmp_path)
    assert "frozen" not in info.manifest
    assert any("base_layer" in name for name in _stored_names(info))
