"""The GPU preflight (engine/state/preflight.py), with the failure faked: a GPU whose architecture this torch was not
built for (a Kaggle P100, sm_60), and a first CUDA operation that really fails (this machine has no GPU: a tensor put
on "cuda" raises). Before anything is loaded: exit 2 naming what happened and the fix, or the CPU where allowed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.utils.data import TensorDataset

import resumable
from resumable import Reporting, Run
from resumable.cli import train_command
from resumable.engine.state import preflight
from resumable.engine.state.preflight import DeviceUnusable, cuda_problem, runs_on

P100 = ("Tesla P100-PCIE-16GB", (6, 0))
BUILT = ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


@pytest.fixture
def lying_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch tells resumable a P100 is there (torch's own internals, e.g. the optimizer's step, still see none); this
    torch was built for sm_70 and later (as Kaggle's image is)."""
    monkeypatch.setattr(torch.cuda, "is_available",
                        lambda: sys._getframe(1).f_globals.get("__name__", "").startswith("resumable."))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: P100[0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: P100[1])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: BUILT)


def test_an_architecture_runs_from_its_own_binary_or_older_ptx() -> None:
    assert not runs_on((6, 0), BUILT)
    assert runs_on((7, 5), BUILT) and runs_on((8, 9), ["sm_80", "sm_86"])  # sm_86 binaries run on sm_89
    assert runs_on((9, 0), ["sm_80", "compute_80"]) and not runs_on((7, 0), ["compute_80"])
    assert runs_on((6, 0), [])  # unknown: the operation decides


def test_an_architecture_this_torch_was_not_built_for_is_named(lying_gpu: None) -> None:
    problem = cuda_problem(torch.device("cuda", 0))
    assert problem is not None and "CUDA device 0 (Tesla P100-PCIE-16GB, sm_60)" in problem
    assert "not among the GPU architectures this torch" in problem and "sm_70" in problem


def test_a_first_cuda_operation_that_fails_is_named(lying_gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_60", *BUILT])  # the list admits it: the op decides
    problem = cuda_problem(torch.device("cuda", 0))  # no GPU here: putting a tensor on it really raises
    assert problem is not None and "failed its first CUDA operation: " in problem, problem


def test_the_cpu_is_taken_only_when_allowed(lying_gpu: None, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DeviceUnusable, match=r"sm_60.*allow_cpu=True to fall back") as refused:
        resumable.usable_device()
    assert refused.value.exit_code == 2 and "Kaggle" not in str(refused.value)
    assert resumable.usable_device(allow_cpu=True) == torch.device("cpu")
    assert "training on the CPU instead (allowed)" in capsys.readouterr().err
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    with pytest.raises(DeviceUnusable, match="In Kaggle: Settings > Accelerator > GPU T4 x2"):
        resumable.usable_device()
    assert resumable.usable_device("cpu") == torch.device("cpu")


def test_a_run_on_a_gpu_that_fails_stops_before_its_run_dir_is_touched(lying_gpu: None, tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    training = Run(tmp_path / "run", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                   data=TensorDataset(torch.randn(8, 2)), batch_size=4, device="cuda",
                   reporting=Reporting(progress=False))
    with pytest.raises(DeviceUnusable, match=r"sm_60.*Nothing was loaded or trained. .*device='cpu'"):
        for _ in training:
            pass
    assert not (tmp_path / "run").exists()


def test_resumable_train_exits_2_with_the_fix_or_falls_back_when_allowed(lying_gpu: None, tiny_mnist: Path,
                                                                         tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    base = ["--run-dir", str(tmp_path / "run"), "--data-dir", str(tiny_mnist), "--max-steps", "2", "--no-progress",
            "--no-download"]
    refused = CliRunner().invoke(train_command, base)
    assert refused.exit_code == 2, refused.output
    assert "sm_60" in refused.output and "--cpu-fallback to fall back to it" in refused.output
    assert not (tmp_path / "run" / "checkpoints").exists()
    fallen = CliRunner().invoke(train_command, [*base, "--cpu-fallback"])
    assert fallen.exit_code == 0, fallen.output
    assert "training on the CPU instead (allowed)" in caplog.text and "training on cpu" in caplog.text


def test_the_preflight_passes_a_cpu_device_without_looking() -> None:
    preflight.check_cuda(torch.device("cpu"))  # nothing to check, nothing raised
