"""CUDA correctness checks, run by scripts/gpu_check.sh on a machine with a GPU.

1. CUDA RNG restore: capture, draw, restore, draw again → identical.
2. AMP kill/resume equivalence on CUDA for fp16 (+ GradScaler) and bf16: an uninterrupted run vs a run
   SIGKILLed twice (once inside a checkpoint write) and resumed → identical fingerprint and metrics.
3. A different device every session: a CPU checkpoint resumed on CUDA and back on the CPU (each resume logs the
   one cross-device line; the CUDA RNG states are skipped on the CPU; each manifest records its device), --amp auto
   on this GPU, and the bf16 → fp16 switch with a fresh CUDA GradScaler (the probe answers as a T4 would).
4. The staging buffer of a background save page-locks exactly its size (not torch's power-of-two rounding).
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

from resumable.engine.state.train_state import capture_rng, restore_rng
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


def _manifest(run_dir: Path) -> dict:
    from resumable.checkpoint import CheckpointManager, checkpoints_dir

    return CheckpointManager(checkpoints_dir(run_dir)).latest_valid()[0].manifest


def _session(run_dir: Path, data: str, device: str, steps: int, *extra: str) -> str:
    args = ["--run-dir", str(run_dir), "--data-dir", data, "--device", device, "--max-steps", str(steps),
            "--checkpoint-steps", "20", "--no-progress", "--no-download", *extra]
    done = subprocess.run(TRAIN + args, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"FAIL {device} session of {run_dir.name}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return done.stderr


def check_cross_device(data: str, root: Path) -> None:
    from resumable.engine.state import hardware

    run_dir = root / "cross-device"
    gpu = hardware.label(hardware.describe("cuda"))
    _session(run_dir, data, "cpu", 20)
    assert _manifest(run_dir)["device_type"] == "cpu"
    log = _session(run_dir, data, "cuda", 40)
    line = f"checkpoint written on cpu, resuming on {gpu}: the run continues, but bit-identity"
    assert log.count(line) == 1, log
    body = _manifest(run_dir)
    assert body["step"] == 40 and body["device_type"] == "cuda" and body["gpu_name"] and body["gpu_capability"], body
    log = _session(run_dir, data, "cpu", 60)
    assert log.count(f"checkpoint written on {gpu}, resuming on cpu: the run continues") == 1, log
    # (CUDA is still available to this CPU session, so its CUDA RNG states are restored, not skipped: the skip
    # without CUDA is tests/test_devices.py's)
    assert _manifest(run_dir)["device_type"] == "cpu" and _manifest(run_dir)["step"] == 60
    print(f"ok   cross-device resume cpu → {gpu} → cpu: one line each way, devices recorded")


def check_amp_auto(data: str, root: Path) -> None:
    """--amp auto on this GPU, then (in this process, with the probe answering as a T4) a bf16 checkpoint switched
    to fp16 with a fresh GradScaler on CUDA."""
    from click.testing import CliRunner

    from resumable.cli import train_command
    from resumable.engine.state import hardware

    capability, native = hardware.probe("cuda")
    expected = hardware.choose_amp("cuda", capability, native)
    run_dir = root / "amp-auto"
    _session(run_dir, data, "cuda", 20, "--amp", "auto")
    assert _manifest(run_dir)["amp_dtype"] == expected, _manifest(run_dir)
    print(f"ok   --amp auto on sm_{capability[0]}{capability[1]} (native bf16: {native}) picked {expected}")

    switched = root / "amp-switch"
    _session(switched, data, "cuda", 20, "--amp", "bf16")
    real = hardware.probe
    hardware.probe = lambda device: ((7, 5), False)
    try:
        result = CliRunner().invoke(train_command, ["--run-dir", str(switched), "--data-dir", data, "--device", "cuda",
                                                    "--max-steps", "40", "--amp", "auto", "--no-progress",
                                                    "--no-download"], catch_exceptions=False)
    finally:
        hardware.probe = real
    assert result.exit_code == 0 and "Switching to fp16 with a fresh GradScaler" in result.output, result.output
    body = _manifest(switched)
    assert body["step"] == 40 and body["computation"]["amp"] == "fp16" and body["amp_dtype"] == "fp16", body
    starts = [json.loads(line) for line in (switched / "sessions.jsonl").read_text().splitlines()]
    assert [r for r in starts if r["event"] == "start"][-1]["amp_switch"]["to"] == "fp16"
    _session(switched, data, "cuda", 60, "--amp", "auto")  # fp16 now: kept, the scaler resumes
    print("ok   bf16 checkpoint → fp16 + fresh GradScaler on CUDA under --amp auto, recorded, and resumed again")


def _rss() -> int:
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmRSS:"))) * 1024


def check_pinned_staging(size: int = 1_100_000_000) -> None:
    """The staging buffer of a background save page-locks exactly the state's size (issue #31 item 5); torch's
    pinned allocator, the old way, rounds a block up to the next power of two (1.1 GB -> 2.1 GB)."""
    from resumable.checkpoint.staging import Staging, aligned

    before = _rss()
    staging = Staging(aligned(size))
    staging.prepare(size, pinned=True)
    registered = _rss() - before
    source = torch.ones(size // 4, device="cuda")
    staging.view(0, size).view(torch.float32).copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    same = bool((staging.view(0, size).view(torch.float32)[-1000:] == 1).all())
    locked = staging.locked
    staging.free()
    del source
    before = _rss()
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    rounded = _rss() - before
    del pinned
    ok = locked and same and registered <= aligned(size) * 1.02
    print(f"{'ok  ' if ok else 'FAIL'} pinned staging: a {size / 1e9:.2f} GB state -> {registered / 1e9:.2f} GB "
          f"resident and page-locked={locked} (budget {aligned(size) / 1e9:.2f} GB), async device copy correct="
          f"{same}; torch's pin_memory=True took {rounded / 1e9:.2f} GB resident for the same size")


def main() -> None:
    data = sys.argv[1]
    check_cuda_rng()
    check_pinned_staging()
    with tempfile.TemporaryDirectory() as root:
        for amp in ("fp16", "bf16"):
            check_amp_resume(data, amp, Path(root))
        check_cross_device(data, Path(root))
        check_amp_auto(data, Path(root))


if __name__ == "__main__":
    main()
