"""A different device every session (issue #18): what each checkpoint records about its device, the one line a
resume on another device logs, ``--amp auto`` and its bf16 -> fp16 switch on a GPU without native bf16.

There is no GPU in CI: checkpoints are trained on the CPU and their manifests rewritten (and re-sealed) to say they
were written on a T4, and the capability probes are monkeypatched. scripts/gpu_check.py covers the CUDA side (a CPU
checkpoint resumed on CUDA and back, and --amp auto on the real GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from resumable.checkpoint import CheckpointManager, InvalidCheckpoint, checkpoints_dir, manifest
from resumable.checkpoint import format as fmt
from resumable.checkpoint.manifest import seal
from resumable.cli import train_command
from resumable.engine.state import hardware
from resumable.engine.state.train_state import capture_rng, restore_rng
from resumable.reporting.history import SESSIONS

T4 = {"device": "cuda:0", "device_type": "cuda", "gpu_name": "Tesla T4", "gpu_capability": [7, 5],
      "cuda_version": "12.4"}
CROSS_LINE = ("checkpoint written on cuda (Tesla T4, sm_75), resuming on cpu: the run continues, but bit-identity "
              "with an uninterrupted run is only promised on the same device")


def train(run_dir: Path, data: Path, *args: str, ok: bool = True) -> str:
    result = CliRunner().invoke(
        train_command, ["--run-dir", str(run_dir), "--data-dir", str(data), "--batch-size", "16", "--epochs", "2",
                        "--log-every", "1", "--no-progress", "--no-download", *args], catch_exceptions=False)
    assert (result.exit_code == 0) == ok, result.output
    return result.output


def newest(run_dir: Path):
    return CheckpointManager(checkpoints_dir(run_dir)).latest_valid()[0]


def rewrite(run_dir: Path, **fields) -> None:
    """Make every checkpoint of ``run_dir`` say it was written elsewhere (re-sealed: a valid manifest)."""
    for info in CheckpointManager(checkpoints_dir(run_dir)).inspect():
        body = {k: v for k, v in info.manifest.items() if k != manifest.CHECKSUM_FIELD}
        fmt.write_json_atomic(info.path / fmt.MANIFEST, seal({**body, **fields}))


def starts(run_dir: Path) -> list[dict]:
    lines = (run_dir / SESSIONS).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "start"]


# -- choose_amp: the table of the README -------------------------------------------------------------------
@pytest.mark.parametrize(("device", "capability", "native", "expected"), [
    ("cuda", (7, 5), False, "fp16"),   # T4
    ("cuda", (8, 9), True, "bf16"),    # L4
    ("cuda", (8, 0), True, "bf16"),    # A100
    ("cuda", (7, 0), False, "fp16"),   # V100
    ("cuda", (9, 0), True, "bf16"),    # H100
    ("cuda", (7, 5), None, "fp16"),    # probe unknown: judged from the capability
    ("cuda", (8, 6), None, "bf16"),
    ("cpu", None, None, "none"),
], ids=["T4", "L4", "A100", "V100", "H100", "T4-unprobed", "A10-unprobed", "cpu"])
def test_choose_amp_picks_bf16_only_where_native(device, capability, native, expected) -> None:
    assert hardware.choose_amp(device, capability, native) == expected


@pytest.mark.parametrize(("saved", "device", "capability", "native", "expected", "switches"), [
    ("bf16", "cuda", (7, 5), False, "fp16", True),   # bf16 run lands on a T4: the one switch
    ("bf16", "cuda", (8, 0), True, "bf16", False),   # on an A100: kept
    ("bf16", "cpu", None, None, "bf16", False),      # on the CPU: bf16 autocast runs there; kept
    ("fp16", "cuda", (8, 9), True, "fp16", False),   # an fp16 run moved to an L4: not switched back
    ("fp16", "cpu", None, None, "fp16", False),
    ("none", "cuda", (8, 0), True, "none", False),   # a float32 run stays float32
])
def test_resume_amp_keeps_the_checkpoints_choice_unless_bf16_lands_on_an_older_gpu(
        saved, device, capability, native, expected, switches) -> None:
    amp, why = hardware.resume_amp(saved, device, capability, native)
    assert amp == expected and (why is not None) == switches


def test_the_bf16_probe_asks_for_native_support_only() -> None:
    # torch.cuda.is_bf16_supported counts emulation by default (a T4 would say yes); the probe passes False
    import inspect

    assert "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters
    assert hardware.probe("cpu") == (None, None)


def test_cross_device_line_names_both_devices_and_ignores_what_older_checkpoints_lack() -> None:
    here = {"device": "cpu", "device_type": "cpu"}
    assert hardware.cross_device_line(T4, here) == CROSS_LINE
    assert hardware.cross_device_line(T4, T4) is None
    l4 = {**T4, "gpu_name": "NVIDIA L4", "gpu_capability": [8, 9]}
    moved = hardware.cross_device_line(T4, l4)
    assert moved is not None and "written on cuda (Tesla T4, sm_75), resuming on cuda (NVIDIA L4, sm_89)" in moved
    assert hardware.cross_device_line({"device": "cuda:0"}, T4) is None  # before GPU names were recorded
    assert hardware.cross_device_line({"device": "cuda:0"}, here).startswith("checkpoint written on cuda, resuming")
    assert hardware.cross_device_line({}, here) is None  # nothing recorded: nothing claimed
    avx2, avx512 = {**here, "cpu_capability": "AVX2"}, {**here, "cpu_capability": "AVX512"}
    assert "kernels use AVX2, resuming on one that uses AVX512" in hardware.cross_device_line(avx2, avx512)
    assert hardware.cross_device_line(avx512, avx512) is None and hardware.cross_device_line(here, avx512) is None
    assert hardware.describe("cpu")["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


# -- what each checkpoint records --------------------------------------------------------------------------
def test_each_checkpoint_records_its_device_and_amp_dtype(tiny_mnist: Path, tmp_path: Path) -> None:
    output = train(tmp_path, tiny_mnist, "--max-steps", "3", "--amp", "auto")
    assert "--amp auto: none on cpu" in output
    body = newest(tmp_path).manifest
    assert body["device_type"] == "cpu" and body["amp_dtype"] == "none"
    assert body["torch_version"] == torch.__version__ and body.get("cuda_version") == torch.version.cuda
    assert "gpu_name" not in body and "gpu_capability" not in body  # CUDA only
    assert body["config"]["amp"] == "auto" and body["computation"]["amp"] == "none"  # asked vs. used
    assert starts(tmp_path)[-1]["device"] == "cpu"


def test_manifest_device_fields_are_optional_and_validated() -> None:
    base = {"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "step": 1, "created_unix": 1.0,
            "files": {"meta.pt": {"size": 1, "sha256": "0" * 64}}}
    manifest.parse(json.dumps(seal(base)).encode())  # none of them: an older checkpoint, still valid
    good = manifest.parse(json.dumps(seal({**base, **T4, "amp_dtype": "bf16"})).encode())
    assert good.body["gpu_capability"] == [7, 5]
    for field, value in (("gpu_capability", [7]), ("gpu_capability", "7.5"), ("gpu_capability", [7, True]),
                         ("amp_dtype", "fp8"), ("gpu_name", 75), ("device_type", None)):
        with pytest.raises(InvalidCheckpoint, match=field):
            manifest.parse(json.dumps(seal({**base, field: value})).encode())


# -- a checkpoint from a GPU, resumed on the CPU -----------------------------------------------------------
def test_a_t4_checkpoint_resumes_on_cpu_with_one_line_and_completes(tiny_mnist: Path, tmp_path: Path) -> None:
    train(tmp_path, tiny_mnist, "--max-steps", "4", "--amp", "bf16")
    rewrite(tmp_path, **T4, amp_dtype="bf16")
    output = train(tmp_path, tiny_mnist, "--max-steps", "12")
    assert output.count(CROSS_LINE) == 1, output
    assert output.count("bit-identity") == 1, output  # one line, not one per restored part
    assert "resuming from step 4" in output and "done at step 12" in output
    body = newest(tmp_path).manifest
    assert body["step"] == 12 and body["device_type"] == "cpu" and body["amp_dtype"] == "bf16"
    assert starts(tmp_path)[-1]["device"] == "cpu" and "amp_switch" not in starts(tmp_path)[-1]


def test_cuda_rng_states_are_skipped_without_cuda_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    state = capture_rng()
    expected = torch.rand(3)
    torch.rand(10)
    restore_rng({**state, "cuda": [torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)]})
    assert torch.equal(torch.rand(3), expected)  # the CPU streams were restored
    assert "skipping the checkpoint's 2 CUDA RNG state(s): CUDA is not available here" in capsys.readouterr().err


# -- the bf16 -> fp16 switch of --amp auto ---------------------------------------------------------------
@pytest.fixture()
def on_a_t4(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU session answers the AMP decision as a T4 would (no native bf16); the training itself runs on the
    CPU, where fp16 autocast and a GradScaler exist in this torch."""
    real = hardware.resume_amp
    monkeypatch.setattr(hardware, "resume_amp", lambda saved, device, capability, native: real(saved, "cuda", (7, 5),
                                                                                                   False))
    monkeypatch.setattr(hardware, "label", lambda record: "cuda (Tesla T4, sm_75)")


def test_bf16_checkpoint_under_amp_auto_switches_to_fp16_loudly_and_records_it(
        tiny_mnist: Path, tmp_path: Path, on_a_t4: None) -> None:
    train(tmp_path, tiny_mnist, "--max-steps", "4", "--amp", "bf16")
    assert newest(tmp_path).manifest["computation"]["amp"] == "bf16"
    output = train(tmp_path, tiny_mnist, "--max-steps", "8", "--amp", "auto")
    assert ("--amp auto: this run trained with bf16 up to step 4, but cuda (Tesla T4, sm_75) has no native bf16"
            in output), output
    assert "Switching to fp16 with a fresh GradScaler" in output and "done at step 8" in output
    switch = starts(tmp_path)[-1]["amp_switch"]
    assert (switch["from"], switch["to"], switch["step"]) == ("bf16", "fp16", 4) and "Tesla T4" in switch["why"]
    info = newest(tmp_path)
    assert info.manifest["computation"]["amp"] == "fp16" and info.manifest["amp_dtype"] == "fp16"
    scaler = CheckpointManager(checkpoints_dir(tmp_path)).load(info)["scaler"]
    assert scaler is not None and scaler["scale"] > 0  # the fresh GradScaler is checkpointed from now on
    from resumable.reporting.history import read_sessions

    last = read_sessions(tmp_path)[-1]
    assert last.amp_switch == switch and last.device == "cuda (Tesla T4, sm_75)"  # the label is patched as a T4's
    # The next session continues in fp16 (the checkpoint's own choice now): no second switch.
    output = train(tmp_path, tiny_mnist, "--max-steps", "10", "--amp", "auto")
    assert "Switching" not in output and "amp_switch" not in starts(tmp_path)[-1] and "done at step 10" in output


@pytest.mark.parametrize(("gpu", "probed", "expected"), [
    ("T4", ((7, 5), False), "fp16"), ("L4", ((8, 9), True), "bf16"), ("A100", ((8, 0), True), "bf16"),
    ("V100", ((7, 0), False), "fp16")])
def test_amp_auto_resolves_on_a_cuda_device_from_the_probe(monkeypatch: pytest.MonkeyPatch, gpu, probed,
                                                           expected) -> None:
    """resumable-train's own resolution on a CUDA device (a torch.device needs no GPU; the probe is patched)."""
    from resumable.tasks.train_mnist import _resolve_amp

    monkeypatch.setattr(hardware, "probe", lambda device: probed)
    cuda = torch.device("cuda", 0)
    assert _resolve_amp("auto", cuda, None, 0) == (expected, None)  # a fresh run
    amp, switch = _resolve_amp("auto", cuda, {"amp": "bf16"}, 40)  # a bf16 run resumed here
    assert amp == expected and (switch is not None) == (expected == "fp16")
    assert _resolve_amp("auto", cuda, {"amp": "fp16"}, 40) == ("fp16", None)  # never switched back to bf16
    assert _resolve_amp("auto", cuda, {}, 40) == ("none", None)  # a checkpoint from before --amp: float32


def test_explicit_bf16_on_a_gpu_without_native_bf16_is_obeyed_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from resumable.tasks.train_mnist import _resolve_amp

    monkeypatch.setattr(hardware, "probe", lambda device: ((7, 5), False))
    assert _resolve_amp("bf16", torch.device("cuda", 0), {"amp": "bf16"}, 40) == ("bf16", None)
    err = capsys.readouterr().err
    assert "--amp bf16 on cuda, which has no native bf16" in err and "--amp auto trains with fp16" in err
    monkeypatch.setattr(hardware, "probe", lambda device: ((8, 0), True))
    assert _resolve_amp("bf16", torch.device("cuda", 0), None, 0) == ("bf16", None)
    assert "native bf16" not in capsys.readouterr().err


def test_the_switch_is_only_accepted_under_amp_auto(tiny_mnist: Path, tmp_path: Path, on_a_t4: None) -> None:
    train(tmp_path, tiny_mnist, "--max-steps", "4", "--amp", "bf16")
    output = train(tmp_path, tiny_mnist, "--max-steps", "6", "--amp", "fp16", ok=False)
    assert "amp differs from the checkpoint" in output and "checkpoint 'bf16', now 'fp16'" in output
    output = train(tmp_path, tiny_mnist, "--max-steps", "6")  # the inherited explicit bf16 is kept
    assert "Switching" not in output and newest(tmp_path).manifest["computation"]["amp"] == "bf16"


def test_amp_auto_keeps_an_fp16_checkpoint_and_refuses_a_different_explicit_amp(tiny_mnist: Path,
                                                                                   tmp_path: Path) -> None:
    train(tmp_path, tiny_mnist, "--max-steps", "3", "--amp", "fp16")
    output = train(tmp_path, tiny_mnist, "--max-steps", "5", "--amp", "auto")
    assert "keeping the checkpoint's fp16 on cpu" in output
    assert newest(tmp_path).manifest["computation"]["amp"] == "fp16"
    output = train(tmp_path, tiny_mnist, "--max-steps", "6", "--amp", "bf16", ok=False)  # saved config: auto
    assert "checkpoint 'fp16', now 'bf16'" in output
