"""CUDA correctness checks, run by scripts/gpu_check.sh on a machine with a GPU.

1. CUDA RNG restore: capture, draw, restore, draw again → identical.
2. AMP kill/resume equivalence on CUDA for fp16 (+ GradScaler) and bf16: an uninterrupted run vs a run
   SIGKILLed twice (once inside a checkpoint write) and resumed → identical fingerprint and metrics.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from resumable.engine.state import capture_rng, restore_rng
from resumable.faults import Faults
from resumable.reporting.metrics import read_records, without_timing

TRAIN = [sys.executable, "-c", "from resumable.cli import train_command; train_command()"]
ARGS = ["--max-steps", "300", "--checkpoint-steps", "40", "--log-every", "1", "--no-progress", "--no-download",
        "--device", "cuda"]


def check_cuda_rng() -> None:
    torch.manual_seed(0)
    torch.rand(3, device="cuda")
    state = capture_rng()
    first = torch.rand(5, device="cuda")
    torch.rand(100, device="cuda")
    restore_rng(state)
    assert torch.equal(first, torch.rand(5, device="cuda")), "CUDA RNG restore failed"
    assert len(state["cuda"]) == torch.cuda.device_count()
    print("ok   CUDA RNG restore")


def _fingerprint(run_dir: Path) -> str:
    out = subprocess.run([sys.executable, "-c", "from resumable.cli import main; main()", "inspect", "--json",
                          str(run_dir)], capture_output=True, text=True, check=True).stdout
    return json.loads(out)["latest_valid"]["fingerprint"]


def _max_step(run_dir: Path) -> int:
    return max((r.get("step", 0) for r in read_records(run_dir / "metrics.jsonl")), default=0)


def _run_until(run_dir: Path, args: list[str], condition, env: dict[str, str]) -> None:
    proc = subprocess.Popen(TRAIN + ["--run-dir", str(run_dir), *args], env={**os.environ, **env},
                            stderr=subprocess.DEVNULL)
    while proc.poll() is None and not condition():
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def check_amp_resume(data: str, amp: str, root: Path) -> None:
    args = ["--data-dir", data, "--amp", amp, *ARGS]
    straight, killed = root / f"{amp}-straight", root / f"{amp}-killed"
    subprocess.run(TRAIN + ["--run-dir", str(straight), *args], check=True, stderr=subprocess.DEVNULL)

    def saving() -> bool:
        ckpts = killed / "checkpoints"
        return ckpts.is_dir() and any(d.is_dir() and any(d.glob("shard-*")) and not (d / "manifest.json").exists()
                                      for d in ckpts.iterdir())

    _run_until(killed, args, saving, Faults(save_delay_s=2).to_env())
    _run_until(killed, args, lambda: _max_step(killed) >= 170, {})
    subprocess.run(TRAIN + ["--run-dir", str(killed), *args], check=True, stderr=subprocess.DEVNULL)
    same_fp = _fingerprint(straight) == _fingerprint(killed)
    same_metrics = (without_timing(read_records(straight / "metrics.jsonl"))
                    == without_timing(read_records(killed / "metrics.jsonl")))
    status = "ok  " if same_fp and same_metrics else "FAIL"
    print(f"{status} AMP {amp} kill/resume on CUDA: fingerprint equal={same_fp}, metrics equal={same_metrics}")
    if status == "FAIL":
        raise SystemExit(1)


def main() -> None:
    data = sys.argv[1]
    check_cuda_rng()
    with tempfile.TemporaryDirectory() as root:
        for amp in ("fp16", "bf16"):
            check_amp_resume(data, amp, Path(root))


if __name__ == "__main__":
    main()
