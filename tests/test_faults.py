"""Disk faults while checkpointing: ENOSPC/EIO in the payload, the manifest, the fsync, and pruning.

Whatever fails, the previous checkpoint stays the newest valid one, no partial checkpoint counts, and
resuming still gives the uninterrupted result."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import env, final_fingerprint, records, small_filesystem

from resumable import atomic
from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.checkpoint import format as fmt
from resumable.checkpoint import manager as manager_module
from resumable.cli import train_command

ARGS = ["--batch-size", "16", "--epochs", "3", "--checkpoint-steps", "2", "--log-every", "1", "--no-progress",
        "--no-download"]


def invoke(run_dir: Path, data: Path, *extra: str):
    return CliRunner().invoke(train_command, ["--run-dir", str(run_dir), "--data-dir", str(data), *ARGS, *extra])


@pytest.fixture(scope="module")
def reference(tiny_mnist: Path, tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("faults-reference")
    assert invoke(run_dir, tiny_mnist).exit_code == 0
    return final_fingerprint(run_dir), records(run_dir)


def fail_once(monkeypatch: pytest.MonkeyPatch, module, name: str, code: int, on_call: int = 2):
    """Make ``module.name`` raise OSError(code) on its ``on_call``-th call only."""
    real = getattr(module, name)
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == on_call:
            raise OSError(code, f"injected {errno.errorcode[code]}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, flaky)
    return calls


# In the soak set: the payload's ENOSPC (test_ddp.py's failed save on rank 0 runs out of a real disk mid-run; the
# payload's EIO takes the same path here) and the manifest's EIO (the manifest's ENOSPC takes the same path).
@pytest.mark.parametrize("target, code", [pytest.param("write_bytes_atomic", errno.ENOSPC, marks=pytest.mark.soak),
                                          ("write_bytes_atomic", errno.EIO), ("write_json_atomic", errno.ENOSPC),
                                          pytest.param("write_json_atomic", errno.EIO, marks=pytest.mark.soak),
                                          ("fsync_dir", errno.EIO)],
                         ids=["payload-ENOSPC", "payload-EIO", "manifest-ENOSPC", "manifest-EIO", "fsync-EIO"])
def test_failed_save_warns_and_training_goes_on(tiny_mnist: Path, tmp_path: Path, monkeypatch, reference,
                                                target: str, code: int) -> None:
    # the manifest's folder fsync is the one in resumable/atomic.py (every atomic replacement goes through it):
    # its first call is the first commit's (the others fail on the second save, after step 2 was committed)
    if target == "fsync_dir":
        fail_once(monkeypatch, atomic, target, code, on_call=1)
    else:
        fail_once(monkeypatch, fmt, target, code)
    result = invoke(tmp_path, tiny_mnist)
    assert result.exit_code == 0, result.output
    assert "warning:" in result.output and errno.errorcode[code] in result.output
    assert "the newest valid checkpoint is still step 2" in result.output
    infos = CheckpointManager(checkpoints_dir(tmp_path)).inspect()
    assert infos[-1].valid and infos[-1].step == 18
    assert (final_fingerprint(tmp_path), records(tmp_path)) == reference


def test_on_save_error_stop_exits_75_and_resumes_identically(tiny_mnist: Path, tmp_path: Path, monkeypatch,
                                                             reference) -> None:
    fail_once(monkeypatch, fmt, "write_bytes_atomic", errno.ENOSPC, on_call=3)
    result = invoke(tmp_path, tiny_mnist, "--on-save-error", "stop")
    assert result.exit_code == 75, result.output
    assert "newest valid checkpoint is step 4" in result.output
    latest, skipped = CheckpointManager(checkpoints_dir(tmp_path)).latest_valid()
    assert latest.step == 4
    monkeypatch.undo()
    result = invoke(tmp_path, tiny_mnist)
    assert result.exit_code == 0 and "resuming from step 4" in result.output, result.output
    assert (final_fingerprint(tmp_path), records(tmp_path)) == reference


def fail_slowly(monkeypatch: pytest.MonkeyPatch, on_call: int, delay_s: float = 1.5) -> None:
    """The ``on_call``-th payload write takes ``delay_s`` and then fails with ENOSPC (in the background)."""
    import time

    real, calls = fmt.write_bytes_atomic, []

    def slow_then_full(*args, **kwargs):
        calls.append(1)
        if len(calls) == on_call:
            time.sleep(delay_s)
            raise OSError(errno.ENOSPC, "injected ENOSPC")
        return real(*args, **kwargs)

    monkeypatch.setattr(fmt, "write_bytes_atomic", slow_then_full)


@pytest.mark.parametrize("policy", ["stop", "warn"])
def test_a_save_failing_after_the_last_step_decides_the_exit(tiny_mnist: Path, tmp_path: Path, monkeypatch,
                                                              policy: str) -> None:
    # The save of step 4 is still in flight when step 5 (the last, mid-epoch) ends; its failure must not be lost.
    fail_slowly(monkeypatch, on_call=2)
    result = invoke(tmp_path, tiny_mnist, "--max-steps", "5", "--on-save-error", policy)
    latest, _ = CheckpointManager(checkpoints_dir(tmp_path)).latest_valid()
    if policy == "stop":
        assert result.exit_code == 75, result.output
        assert "the newest valid checkpoint is step 2" in result.output and "done at step" not in result.output
        assert latest.step == 2
    else:
        assert result.exit_code == 0, result.output
        assert "warning:" in result.output and latest.step == 5


@pytest.mark.parametrize("policy", ["stop", "warn"])
def test_a_failed_final_save_exits_75_not_done(tiny_mnist: Path, tmp_path: Path, monkeypatch, policy: str) -> None:
    fail_once(monkeypatch, fmt, "write_bytes_atomic", errno.ENOSPC, on_call=3)  # saves at steps 2, 4, then 5: final
    result = invoke(tmp_path, tiny_mnist, "--max-steps", "5", "--on-save-error", policy)
    assert result.exit_code == 75, result.output
    assert "stopped early (a checkpoint could not be written): the newest valid checkpoint is step 4" in result.output
    assert "done at step" not in result.output and "Traceback" not in result.output
    monkeypatch.undo()
    result = invoke(tmp_path, tiny_mnist, "--max-steps", "5")
    assert result.exit_code == 0 and "resuming from step 4" in result.output, result.output


def test_prune_failing_half_way_loses_nothing_valid(tiny_mnist: Path, tmp_path: Path, monkeypatch,
                                                    reference) -> None:
    fail_once(monkeypatch, manager_module.paths, "remove_tree", errno.EIO, on_call=1)
    result = invoke(tmp_path, tiny_mnist, "--keep", "1", "--no-keep-best")
    assert result.exit_code == 0, result.output
    assert "pruning old checkpoints failed" in result.output
    infos = CheckpointManager(checkpoints_dir(tmp_path)).inspect()
    assert infos[-1].valid and infos[-1].step == 18
    # The half-pruned directory lost its manifest first, so it can never be taken for a checkpoint.
    assert all(i.valid or i.reason.startswith("no manifest") for i in infos)
    assert final_fingerprint(tmp_path) == reference[0]


def test_low_free_space_is_announced_before_saving(tiny_mnist: Path, tmp_path: Path, monkeypatch) -> None:
    from resumable.engine.state import room

    real = shutil.disk_usage
    monkeypatch.setattr(room.shutil, "disk_usage",
                        lambda path: real(path)._replace(free=1_000_000))
    result = invoke(tmp_path, tiny_mnist, "--max-steps", "6")
    assert result.exit_code == 0
    assert "MB free in" in result.output and "next save may fail" in result.output


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real 48 MB filesystem (tmpfs), so ENOSPC comes from the kernel, not from a mock."""
    with small_filesystem(tmp_path / "disk", "48m") as mount_point:
        yield mount_point


def test_real_disk_full_keeps_the_previous_checkpoint(tiny_mnist: Path, tmp_path: Path, small_disk: Path) -> None:
    reference = tmp_path / "reference"
    assert invoke(reference, tiny_mnist, "--max-steps", "8").exit_code == 0
    run_dir = small_disk / "run"
    keep = ["--keep", "1", "--no-keep-best"]  # a save needs room for one more checkpoint until it prunes
    assert invoke(run_dir, tiny_mnist, "--max-steps", "4", *keep).exit_code == 0
    free = shutil.disk_usage(small_disk).free
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (free - 6_000_000))  # leave less than one checkpoint (about 14 MB)
    before = sorted(p.name for p in checkpoints_dir(run_dir).iterdir())
    result = invoke(run_dir, tiny_mnist, "--max-steps", "8", "--on-save-error", "stop", *keep)
    # Every save would fail: refused at start with the figures, nothing changed (a save failing with ENOSPC
    # mid-run on a real disk: tests/test_ddp.py::test_a_failed_save_on_rank_0_stops_every_rank_without_a_hang).
    assert result.exit_code == 2, result.output
    assert "MB free and a checkpoint needs" in result.output and "nothing was changed" in result.output
    assert sorted(p.name for p in checkpoints_dir(run_dir).iterdir()) == before
    infos = CheckpointManager(checkpoints_dir(run_dir)).inspect()
    assert [i.step for i in infos if i.valid][-1] == 4
    assert all(i.valid for i in infos if i.committed), "no partial checkpoint may count"
    filler.unlink()
    result = invoke(run_dir, tiny_mnist, "--max-steps", "8", *keep)
    assert result.exit_code == 0 and "resuming from step 4" in result.output, result.output
    assert final_fingerprint(run_dir) == final_fingerprint(reference)
    assert records(run_dir) == records(reference)
    assert not list(run_dir.rglob("*.tmp-*")), "the partial save's temp file is cleaned up"


def test_faults_in_the_environment_are_obeyed_only_when_armed_and_said_when_they_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: a stray RESUMABLE_FAULTS (e.g. skip_rng_restore) silently turned off the RNG restore and its check.
    from resumable import Run
    from resumable import faults as hook
    from resumable.faults import ARMED_ENV, FAULTS_ENV, NO_FAULTS, Faults

    monkeypatch.setattr(hook, "_INSTALLED", None)
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"skip_rng_restore": True}))
    monkeypatch.delenv(ARMED_ENV, raising=False)
    assert hook.install_from_env() == NO_FAULTS
    assert "was not armed by resumable chaos" in capsys.readouterr().err
    for name, value in Faults(skip_rng_restore=True).to_env().items():
        monkeypatch.setenv(name, value)

    def tiny() -> Run:
        model = torch.nn.Linear(2, 2)
        return Run(tmp_path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                   data=torch.utils.data.TensorDataset(torch.zeros(4, 2)), batch_size=2)

    run = tiny()
    next(iter(run))
    run.close()
    assert "faults injected" not in capsys.readouterr().err, "the engine never reads the environment for faults"
    assert hook.install_from_env().skip_rng_restore  # chaos's child bootstrap installs them
    run = tiny()
    next(iter(run))  # said as the session starts
    run.close()
    assert "faults injected on purpose (skip_rng_restore=True)" in capsys.readouterr().err


def test_the_bootstrap_hands_a_plain_script_its_faults_and_runs_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    """A command target (``python train.py``, torchrun's workers) gets its faults from chaos's child bootstrap, which
    Faults.to_env puts on PYTHONPATH; a sitecustomize the environment already had still runs."""
    from resumable.faults import Faults

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import os\nos.environ['THEIR_SITECUSTOMIZE'] = 'ran'\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys, torch\nfrom resumable import Run, Checkpointing, Reporting\n"
        "assert os.environ.get('THEIR_SITECUSTOMIZE') == 'ran'\n"
        "model = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "run = Run(sys.argv[1], model=model, optimizer=opt, data=torch.utils.data.TensorDataset(torch.zeros(16, 2)),"
        " batch_size=2, checkpointing=Checkpointing(steps=1), reporting=Reporting(progress=False))\n"
        "for _, step, (x,) in run:\n    opt.zero_grad(); model(x).sum().backward(); opt.step()\n")
    extra = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", extra["PYTHONPATH"])
        planted = Faults(kill_at_step=3).to_env()
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=120, env=env(**planted), stdin=subprocess.DEVNULL)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert "faults injected on purpose (kill_at_step=3)" in done.stderr
    plain = subprocess.run([sys.executable, str(script), str(tmp_path / "plain")], capture_output=True, text=True,
                           timeout=120, env=env(**extra, RESUMABLE_FAULTS=planted["RESUMABLE_FAULTS"],
                                                RESUMABLE_FAULTS_ARMED="1"), stdin=subprocess.DEVNULL)
    assert plain.returncode == 0 and "faults injected" not in plain.stderr, "without the bootstrap: no faults"
