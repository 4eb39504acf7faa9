"""What a commit holds is what a resume needs, and what a resume keeps is its own: every commit loads back safely
(checked as it is written), trainable flags are state, a restore leaves no tensor mapped from a checkpoint file,
and a manifest must agree with the payload it describes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import final_fingerprint, policies

from resumable import Checkpointing, Reporting, Run, Session
from resumable.checkpoint import CheckpointManager, checkpoints_dir, manifest
from resumable.checkpoint import format as fmt
from resumable.checkpoint.manifest import seal
from resumable.cli import main, train_command
from resumable.errors import StateNotLoadable


class Tracker:
    """A user object whose state gains a numpy scalar after the first evaluation (``best = np.float64(loss)``)."""

    def __init__(self) -> None:
        self.best: float | np.float64 = 0.0

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.best = state["best"]


def tiny(run_dir: Path, tracker: Tracker, numpy_from: int | None = None, epochs: int = 2,
         **options) -> Run:  # noqa: ANN003
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    run = Run(run_dir, model=model, optimizer=optimizer, data=data, batch_size=8, epochs=epochs,
              objects={"tracker": tracker}, **policies(progress=False, checkpoint_steps=2, **options))
    for _epoch, step, (x, y) in run:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if numpy_from is not None and step + 1 >= numpy_from:
            tracker.best = np.float64(loss.item())
    return run


def committed(run_dir: Path) -> list[int]:
    return [i.step for i in CheckpointManager(checkpoints_dir(run_dir)).inspect() if i.valid]


@pytest.mark.parametrize("sync", [False, True])
def test_a_state_that_turns_unloadable_later_stops_the_run_and_commits_nothing_of_it(tmp_path: Path,
                                                                                    sync: bool) -> None:
    # Before: checked at the first save only; the run ended "done" (exit 0) with 8 commits that never load, and
    # retention had deleted the loadable ones: the next start found nothing to resume.
    with pytest.raises(StateNotLoadable, match=r"'tracker'.*/tracker/best is a numpy"):
        tiny(tmp_path, Tracker(), numpy_from=5, sync_checkpoints=sync)
    steps = committed(tmp_path)
    assert steps and max(steps) < 6 and 4 in steps  # only the states before the numpy value: each one loads
    manager = CheckpointManager(checkpoints_dir(tmp_path))
    assert all(manager.load(info) is not None for info in manager.inspect() if info.valid)
    again = tiny(tmp_path, Tracker())  # the fixed code resumes from the newest loadable checkpoint
    assert again.finished and again.resumed_from == max(steps)


class Unfreezing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 2)
        self.backbone.requires_grad_(False)  # trained from epoch 1 on


def unfreezing(run_dir: Path, max_steps: int | None = None) -> Run:
    torch.manual_seed(0)
    model = Unfreezing()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)  # every parameter; the frozen ones get no gradient
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    run = Run(run_dir, model=model, optimizer=optimizer, data=data, batch_size=16, epochs=3,
              checkpointing=Checkpointing(steps=2), session=Session(max_steps=max_steps),
              reporting=Reporting(progress=False))
    for epoch, _step, (x, y) in run:
        if epoch >= 1:
            model.backbone.requires_grad_(True)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model.head(torch.relu(model.backbone(x))), y).backward()
        optimizer.step()
    return run


def test_gradual_unfreezing_resumes_with_the_flags_of_the_checkpoint(tmp_path: Path) -> None:
    # Before: every resume after the unfreezing was refused (FrozenMismatch: requires_grad differs).
    assert unfreezing(tmp_path / "ref").finished
    assert unfreezing(tmp_path / "run", max_steps=6).exit_code == 0  # stopped in epoch 1 (4 steps an epoch)
    resumed = unfreezing(tmp_path / "run")
    assert resumed.finished and resumed.resumed_from == 6
    assert final_fingerprint(tmp_path / "run") == final_fingerprint(tmp_path / "ref")


def mapped_from(folder: Path) -> list[str]:
    """The files under ``folder`` this process still maps (a deleted one shows as '(deleted)')."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return sorted({line.split(maxsplit=5)[5] for line in lines if len(line.split(maxsplit=5)) == 6
                   and line.split(maxsplit=5)[5].startswith(str(folder))})


def test_a_resume_keeps_no_view_of_a_checkpoint_file(tmp_path: Path) -> None:
    # Before: the optimizer's moments stayed views of the resumed-from shard, so once retention deleted that
    # checkpoint its space was held for the whole session ('(deleted)' mappings in /proc/self/maps).
    def adam_run(max_steps: int) -> tuple[Run, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        data = torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randint(0, 64, (64,)))
        run = Run(tmp_path, model=model, optimizer=optimizer, data=data, batch_size=8, epochs=4,
                  checkpointing=Checkpointing(steps=2, keep=1, keep_best=False), session=Session(max_steps=max_steps),
                  reporting=Reporting(progress=False))
        for _epoch, _step, (x, y) in run:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        return run, optimizer

    adam_run(4)
    run, optimizer = adam_run(10)  # resumes from step 4, whose checkpoint retention deletes at step 6
    assert run.resumed_from == 4 and committed(tmp_path) == [10]
    assert optimizer.state  # the session's optimizer state is alive
    assert mapped_from(tmp_path) == []


def resealed(step_dir: Path, **changes) -> None:  # noqa: ANN003
    """Edit a committed manifest and give it a correct self-checksum again (a hostile or well-meant edit)."""
    body = {k: v for k, v in json.loads((step_dir / fmt.MANIFEST).read_text()).items() if k != "manifest_sha256"}
    fmt.write_json_atomic(step_dir / fmt.MANIFEST, seal({**body, **changes}))


def test_a_manifest_that_does_not_describe_its_payload_is_not_resumed(tmp_path: Path) -> None:
    # Before: a step folder copied under a newer step's name resumed as that step ("step 12 (epoch 0, batch 6)"),
    # trained on, and lost the same steps in every later session.
    run = tiny(tmp_path, Tracker())
    assert run.finished
    root = checkpoints_dir(tmp_path)
    shutil.copytree(root / "step-000000012", root / "step-000000020")  # 16 steps in all: a "newer" one
    resealed(root / "step-000000020", step=20)
    resumed = tiny(tmp_path, Tracker(), epochs=3)  # one more epoch: it resumes from the newest real checkpoint
    assert resumed.finished and resumed.resumed_from == 16 and resumed.state.step == 24


def test_a_manifest_naming_a_key_twice_is_corrupt(tmp_path: Path) -> None:
    tiny(tmp_path, Tracker())
    step_dir = checkpoints_dir(tmp_path) / "step-000000016"
    text = (step_dir / fmt.MANIFEST).read_text()
    doubled = text.replace('"files": {', '"files": {"meta.pt": {"size": 1, "sha256": "' + "0" * 64 + '"}, ', 1)
    (step_dir / fmt.MANIFEST).write_text(doubled)
    with pytest.raises(fmt.InvalidCheckpoint, match="names \"meta.pt\" twice"):
        manifest.parse(doubled.encode())


def test_a_recorded_option_of_the_wrong_type_falls_back_instead_of_a_traceback(tiny_mnist: Path,
                                                                             tmp_path: Path) -> None:
    args = ["--run-dir", str(tmp_path), "--data-dir", str(tiny_mnist), "--batch-size", "16", "--epochs", "2",
            "--checkpoint-steps", "4", "--max-steps", "12", "--no-progress", "--no-download"]
    assert CliRunner().invoke(train_command, args).exit_code == 0
    newest = checkpoints_dir(tmp_path) / "step-000000012"
    resealed(newest, config={**json.loads((newest / fmt.MANIFEST).read_text())["config"], "epochs": "10"})
    verified = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert 'option "epochs" is "10": must be int' in verified.output, verified.output
    resumed = CliRunner().invoke(train_command, [*args[:-4], "--max-steps", "16", "--no-progress", "--no-download"])
    assert resumed.exit_code == 0, resumed.output
    assert "skipping checkpoint step 12" in resumed.output and "resuming from step 8" in resumed.output


class WithConstant(torch.nn.Module):
    """A trained layer and a large parameter that never changes (no gradient reaches it): its shard is the same in
    every checkpoint, so it is hard-linked rather than written again."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.table = torch.nn.Parameter(torch.randn(4096))


@pytest.mark.parametrize("keep", [2, 3])
def test_with_keep_2_or_more_no_single_damaged_file_invalidates_every_kept_checkpoint(tmp_path: Path,
                                                                                     keep: int) -> None:
    # Before: every kept checkpoint linked the unchanged shard to one inode; one flipped bit invalidated them all.
    torch.manual_seed(0)
    model = WithConstant()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    run = Run(tmp_path, model=model, optimizer=optimizer, data=data, batch_size=8, epochs=1,
              checkpointing=Checkpointing(steps=1, keep=keep, keep_best=False, shard_size="4KB"),
              reporting=Reporting(progress=False))
    for _epoch, _step, (x, y) in run:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model.layer(x), y).backward()
        optimizer.step()
    manager = CheckpointManager(checkpoints_dir(tmp_path))
    kept = [info for info in manager.inspect() if info.valid]
    assert len(kept) == keep
    sharing: dict[int, int] = {}
    for info in kept:
        for name in info.manifest["files"]:
            inode = (info.path / name).stat().st_ino
            sharing[inode] = sharing.get(inode, 0) + 1
    assert max(sharing.values()) <= keep - 1  # every file is missing from at least one kept checkpoint
    assert run.stats.linked > 0 or keep == 2  # with keep 3, unchanged shards are still shared by two
    for inode in sharing:  # damage each shared file in turn: some kept checkpoint stays valid
        path = next(info.path / name for info in kept for name in info.manifest["files"]
                    if (info.path / name).stat().st_ino == inode)
        original = path.read_bytes()
        path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # in place: every link of it sees the flip
        assert manager.latest_valid()[0] is not None, f"one damaged file ({path.name}) invalidated them all"
        path.write_bytes(original)


class _FakeCudart:
    """CUDA's runtime as the staging buffer calls it, recording what it is asked to page-lock."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple] = []
        self.refuse = refuse

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", ptr, size, flags))
        return 1 if self.refuse else 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


def test_pinned_staging_page_locks_exactly_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # Item 5. Before: torch.empty(pin_memory=True), whose allocator rounds a block up to a power of two (a 4.2 GB
    # state locked 8.6 GB). Now ordinary memory of exactly the budgeted size is registered with CUDA. (On a GPU,
    # scripts/gpu_check.sh measures the memory; here CUDA's runtime is a fake that records the calls.)
    from resumable.checkpoint.staging import Staging, aligned

    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    state = 4_200_003  # not a power of two
    staging = Staging(10_000_000)
    staging.prepare(state, pinned=True)
    first = staging.view(0, 1).data_ptr()
    assert staging.locked and staging.allocated == aligned(state) < 2 ** 22 + 2 ** 21
    assert cudart.calls == [("register", first, aligned(state), 1)]
    staging.prepare(state, pinned=True)  # reused: nothing registered again
    assert len(cudart.calls) == 1
    staging.prepare(6_000_000, pinned=True)  # grows: the old buffer is unregistered before the new one is made
    assert cudart.calls[1] == ("unregister", first)
    assert cudart.calls[2][0] == "register" and cudart.calls[2][2] == aligned(6_000_000)
    staging.free()
    assert cudart.calls[3][0] == "unregister" and not staging.locked and staging.allocated == 0


def test_staging_that_cuda_will_not_lock_stays_pageable_within_its_budget(monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from resumable.checkpoint import staging as module
    from resumable.checkpoint.staging import Staging, aligned

    monkeypatch.setattr(module, "_told", [])  # the warning is said once per process
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(refuse=True))
    staging = Staging(10_000_000)
    staging.prepare(3_000_000, pinned=True)
    assert not staging.locked and staging.allocated == aligned(3_000_000)
    assert "could not page-lock" in capsys.readouterr().err
    staging.free()
