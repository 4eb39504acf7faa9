"""FSDP2 models in Run (issue #33): the sharded model and optimizer are checkpointed by every rank through
torch.distributed.checkpoint, committed by resumable's manifest (which lists every rank's file), resumed bit-identical
at the same world size after SIGKILL between saves and inside one, and resharded by DCP at another world size. A
checkpoint whose rank files do not match the world size it records is refused, never loaded in part.

2 CPU ranks with gloo under torchrun (tests/fsdp_train.py); runs are compared with FSDP runs only (pytorch#162338)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import fsdp_train
import pytest
import torch
from helpers import env, final_fingerprint, records

from resumable.checkpoint import CheckpointManager, InvalidCheckpoint, checkpoints_dir, dcp
from resumable.checkpoint import manifest as manifests
from resumable.faults import Faults

pytest.importorskip("torch.distributed.fsdp")

BIN = Path(sys.executable).parent
SCRIPT = Path(__file__).resolve().parent / "fsdp_train.py"


def torchrun(run_dir: Path, result: Path, ranks: int = 2, *extra: str, **extra_env: str) -> subprocess.CompletedProcess:
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(ranks), str(SCRIPT), str(run_dir),
               str(result), *extra]
    return subprocess.run(command, env=env(OMP_NUM_THREADS="1", **extra_env), capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


def result(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-rank run: 24 steps, a checkpoint every 3."""
    where = tmp_path_factory.mktemp("fsdp-reference")
    done = torchrun(where / "run", where / "result.json")
    assert done.returncode == 0, done.stderr[-3000:]
    return where


def test_every_rank_writes_its_shards_and_the_manifest_lists_them(reference: Path) -> None:
    info = CheckpointManager(checkpoints_dir(reference / "run")).latest_valid()[0]
    assert info.step == 24 and info.manifest["sharded"] == dcp.KIND and info.manifest["world_size"] == 2
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"} <= set(info.manifest["files"])


def test_export_gathers_the_sharded_weights_into_one_file(reference: Path, tmp_path: Path) -> None:
    done = subprocess.run([str(BIN / "resumable"), "export", str(reference / "run"), "--out", str(tmp_path / "m.pt")],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert done.returncode == 0, done.stderr
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    assert state["0.weight"].shape == (64, 16), "whole tensors, not one rank's shards"
    assert fsdp_train.model_digest(state) == result(reference / "result.json")["model"]


# Soak set: the kill between saves (the kill inside a save also resumes from a committed checkpoint and compares;
# chaos's soak test kills the FSDP example at random moments).
@pytest.mark.parametrize("fault", [pytest.param({"kill_at_step": 7}, marks=pytest.mark.soak),
                                   {"kill_in_save_at_step": 9}], ids=["between saves", "inside a save"])
def test_sigkill_resumes_to_the_uninterrupted_fsdp_run(reference: Path, tmp_path: Path, fault: dict) -> None:
    killed = torchrun(tmp_path / "run", tmp_path / "killed.json", **Faults(**fault).to_env())
    assert killed.returncode != 0, "the fault killed the ranks"
    resumed = torchrun(tmp_path / "run", tmp_path / "result.json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "model + optimizer shards of rank 0 byte-equal to the checkpoint" in resumed.stderr
    assert result(tmp_path / "result.json")["fingerprint"] == result(reference / "result.json")["fingerprint"]
    assert records(tmp_path / "run") == records(reference / "run")
    # the manifest's fingerprint covers every rank's shards: the same for the same state at the same world size
    assert final_fingerprint(tmp_path / "run") == final_fingerprint(reference / "run")


def test_a_checkpoint_without_one_of_its_rank_files_is_refused(reference: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(reference / "run", run_dir)
    newest = CheckpointManager(checkpoints_dir(run_dir)).latest_valid()[0]
    body = dict(newest.manifest)
    body["files"] = {name: entry for name, entry in body["files"].items() if name != "__1_0.distcp"}
    (newest.path / "__1_0.distcp").unlink()
    (newest.path / "manifest.json").write_text(json.dumps(manifests.seal(body)))  # a consistent, re-sealed manifest
    with pytest.raises(InvalidCheckpoint, match=r"rank files missing: \[1\]"):
        dcp.check_ranks(manifests.read(newest.path).body)
    resumed = torchrun(run_dir, tmp_path / "result.json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "rank files missing: [1]" in resumed.stderr and "resuming from step 21" in resumed.stderr


def test_a_two_rank_checkpoint_resumes_with_one_rank_resharded(reference: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = torchrun(run_dir, tmp_path / "first.json", 2, "10")
    assert first.returncode == 0, first.stderr[-3000:]
    one = torchrun(run_dir, tmp_path / "result.json", 1)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "written by 2 process(es), this run has 1" in one.stderr
    assert "model + optimizer shards of rank 0 byte-equal to the checkpoint" in one.stderr
    assert result(tmp_path / "result.json")["resumed_from"] == 10


def test_two_then_one_then_two_ranks_train_each_sample_once_an_epoch(reference: Path, tmp_path: Path) -> None:
    """2 ranks to step 5, 1 rank to step 14, 2 ranks to the end: every epoch trains each sample once (the position
    is remapped as a count of samples, also when it is not a multiple of the new global batch), with the warning,
    and the loss goes on as in the run that kept 2 ranks (within noise: other batches, other dropout masks)."""
    run_dir, samples = tmp_path / "run", tmp_path / "samples"
    samples.mkdir()
    for ranks, steps in ((2, "5"), (1, "14"), (2, None)):
        done = torchrun(run_dir, tmp_path / "result.json", ranks, *([steps] if steps else []),
                        FSDP_SAMPLES=str(samples))
        assert done.returncode == 0, done.stderr[-3000:]
        if ranks == 1:
            assert "written by 2 process(es), this run has 1: epoch 1 goes on at sample 80 of 192" in done.stderr
    trained: dict[int, list[int]] = {}
    for path in samples.iterdir():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            trained.setdefault(record["epoch"], []).extend(record["ids"])
    assert sorted(trained) == [0, 1]
    for epoch, ids in trained.items():
        assert sorted(ids) == list(range(192)), f"epoch {epoch}: each sample once"
    mixed, kept = ([r["train_loss"] for r in records(where / "run") if "train_loss" in r] for where in (tmp_path,
                                                                                                          reference))
    assert len(mixed) == len(kept) == 2 and abs(mixed[-1] - kept[-1]) < 0.15 * kept[-1], (mixed, kept)


def test_a_sharded_checkpoint_on_drive_comes_back_on_a_fresh_machine(reference: Path, tmp_path: Path) -> None:
    """A mounted-Drive run dir: every rank's shards are mirrored with the rest of the step's folder, and a fresh
    machine (an empty local cache) brings them back and resumes to the uninterrupted run."""
    drive = tmp_path / "drive"
    drive.mkdir()
    run_dir = drive / "run"
    first = torchrun(run_dir, tmp_path / "first.json", 2, "10", RESUMABLE_DRIVE_MOUNT=str(drive),
                     XDG_CACHE_HOME=str(tmp_path / "vm1"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {p.name for p in run_dir.glob("checkpoints/*/*")}
    resumed = torchrun(run_dir, tmp_path / "result.json", RESUMABLE_DRIVE_MOUNT=str(drive),
                       XDG_CACHE_HOME=str(tmp_path / "vm2"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "brought checkpoint step 10 back" in resumed.stderr
    assert result(tmp_path / "result.json")["fingerprint"] == result(reference / "result.json")["fingerprint"]


EXAMPLE = Path(__file__).resolve().parents[1] / "scripts" / "fsdp_example.py"


def test_the_fsdp_example_trains_stops_and_resumes(tmp_path: Path) -> None:
    """scripts/fsdp_example.py (a small transformer, one FSDP unit a block) as docs/torchrun.md runs it."""
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(EXAMPLE), "--run-dir",
               str(tmp_path / "run"), "--checkpoint-steps", "3"]
    for steps in ("3", "6"):
        done = subprocess.run([*command, "--max-steps", steps], env=env(OMP_NUM_THREADS="1"), capture_output=True,
                              text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from step 3" in done.stderr and "done at step 6" in done.stderr


@pytest.mark.soak
def test_chaos_kills_the_fsdp_example_and_it_ends_identical(tmp_path: Path) -> None:
    """`resumable chaos` on torchrun with 2 FSDP ranks: SIGKILL at random moments (some inside a save), resumed each
    time; the final state (every rank's shards) equals an uninterrupted run's."""
    command = [str(BIN / "resumable"), "chaos", "--target", "command", "--kills", "3", "--every", "3s", "--seed", "7",
               "--workdir", str(tmp_path / "chaos"), "--", str(BIN / "torchrun"), "--standalone", "--nproc-per-node",
               "2", str(EXAMPLE), "--run-dir", "{run_dir}", "--max-steps", "30", "--checkpoint-steps", "3"]
    done = subprocess.run(command, env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=1800,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and "IDENTICAL" in done.stdout, (done.stdout[-3000:], done.stderr[-3000:])


PORTABLE = Path(__file__).resolve().parent / "portable_train.py"


def portable(run_dir: Path, result: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(PORTABLE), str(run_dir), str(result),
               *extra]
    return subprocess.run(command, env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


def test_a_loop_with_its_own_dcp_checkpoints_resumes_exactly_with_resumables_state(tmp_path: Path) -> None:
    """A torchtitan-style loop (its own FSDP2 model, loop and DCP checkpoints) puts PortableState in its checkpoints:
    stopped after step 8 and resumed from step 6, it ends with the state of the run that was never stopped (the
    data position, the per-rank counters and the dropout RNG all came back)."""
    whole = portable(tmp_path / "whole", tmp_path / "whole.json")
    assert whole.returncode == 0, whole.stderr[-3000:]
    stopped = portable(tmp_path / "run", tmp_path / "stopped.json", "8")
    assert stopped.returncode != 0 and (tmp_path / "run" / "latest").read_text() == "step-6"
    resumed = portable(tmp_path / "run", tmp_path / "result.json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert result(tmp_path / "result.json") == result(tmp_path / "whole.json")
