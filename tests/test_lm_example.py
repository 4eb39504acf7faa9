"""scripts/lm_example.py (a tiny GPT on bytes streamed from local files: AdamW warmup+cosine, clipping, bf16
autocast, accumulation 4, optionally LoRA), killed twice with SIGKILL (mid-epoch, then inside a save or on the
first step after the resume) and resumed, ends identical to an uninterrupted run: same final fingerprint, same
loss at every step. Each case takes well under a minute on CPU."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import env, final_fingerprint, newest_valid, records

from resumable.faults import Faults

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "lm_example.py"
OPTIONS = ["--max-steps", "24", "--checkpoint-steps", "4", "--log-every", "1", "--max-files", "20"]


def _train(run_dir: Path, extra: list[str], faults: Faults | None = None) -> subprocess.CompletedProcess:
    """A session that is killed runs as its own process; the others in this one (no interpreter start)."""
    if faults is None:
        spec = importlib.util.spec_from_file_location("lm_example", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = module.main(["--run-dir", str(run_dir), *OPTIONS, *extra])
        return subprocess.CompletedProcess([], code, "", stderr.getvalue())
    return subprocess.run([sys.executable, str(SCRIPT), "--run-dir", str(run_dir), *OPTIONS, *extra],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env=env(**(faults.to_env() if faults is not None else {})))


def _killed(run_dir: Path, extra: list[str], faults: Faults) -> str:
    done = _train(run_dir, extra, faults)
    assert done.returncode == -signal.SIGKILL, f"the kill must land:\n{done.stderr[-3000:]}"
    return done.stderr


def _newest_step(run_dir: Path) -> int:
    return newest_valid(run_dir).step


def _same_as_reference(tmp_path: Path, run_dir: Path, extra: list[str]) -> None:
    reference = tmp_path / "reference"
    assert _train(reference, extra).returncode == 0
    assert final_fingerprint(run_dir) == final_fingerprint(reference)
    steps = records(run_dir)
    assert steps == records(reference) and [r["step"] for r in steps if "loss" in r] == list(range(1, 25))


# Soak set (about 26 s): the default run kills the LoRA variant twice below, and kills streams with workers and
# inside a save in test_stream.py and test_kill.py.
@pytest.mark.soak
def test_lm_example_with_workers_killed_twice_ends_identical(tmp_path: Path) -> None:
    extra, run_dir = ["--num-workers", "2"], tmp_path / "run"
    _killed(run_dir, extra, Faults(kill_at_step=10))  # mid-epoch, after the checkpoint of step 8
    newest = _newest_step(run_dir)
    stderr = _killed(run_dir, extra, Faults(kill_in_save_at_step=16))  # inside a save: never committed
    assert f"resuming from step {newest}" in stderr and "resume verified in" in stderr
    assert _newest_step(run_dir) < 16
    done = _train(run_dir, extra)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from step 12" in done.stderr and "replaying" not in done.stderr  # seeks: state_dict protocol
    _same_as_reference(tmp_path, run_dir, extra)


def test_lm_example_with_lora_killed_on_the_first_step_after_a_resume_ends_identical(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    extra, run_dir = ["--lora"], tmp_path / "run"
    _killed(run_dir, extra, Faults(kill_at_step=10))  # mid-epoch, after the checkpoint of step 8
    newest = _newest_step(run_dir)
    stderr = _killed(run_dir, extra, Faults(kill_at_step=newest + 1))  # the very first step after the resume
    assert f"resuming from step {newest}" in stderr and "resume verified in" in stderr
    assert _newest_step(run_dir) == newest
    done = _train(run_dir, extra)
    assert done.returncode == 0 and f"resuming from step {newest}" in done.stderr, done.stderr[-3000:]
    assert "frozen tensor(s)" in done.stderr  # the base is checked by sha256, not stored
    _same_as_reference(tmp_path, run_dir, extra)
