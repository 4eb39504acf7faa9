"""Regression tests for the engine bugs found in review (issue #14): each one failed on the code before its fix.

They use only the public API (resumable.Run) and a tiny model, so each runs in a second or two.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import policies

from resumable import Loader, Reporting, Run
from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.checkpoint.snapshot import Snapshotter
from resumable.errors import ResumableError, RunDirInUse
from resumable.storage import open_run_location


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 8)
        self.drop = torch.nn.Dropout(0.5)
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.fc(x))))


def tiny_run(run_dir: Path, **options) -> Run:
    torch.manual_seed(0)
    model = TinyNet()
    data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    defaults = {"batch_size": 8, "epochs": 2, "progress": False}
    return Run(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data,
               **policies(run_dir=run_dir, **{**defaults, **options}))


def train(run: Run, body=None) -> Run:
    for epoch, step, (x, y) in run:
        loss = torch.nn.functional.cross_entropy(run.model(x), y)
        run.optimizer.zero_grad()
        loss.backward()
        run.optimizer.step()
        run.log(loss)
        if body is not None:
            body(run, epoch, step)
    return run


def newest(run_dir: Path):
    latest, _ = CheckpointManager(checkpoints_dir(run_dir)).latest_valid()
    return latest


# 1. config values that JSON changes (tuples, int keys) or cannot encode
def test_a_config_with_tuples_and_int_keys_resumes(tmp_path: Path) -> None:
    config = {"dims": (1, 2), "names": {1: "a", 2: "b"}, "nested": [(3, 4)]}
    train(tiny_run(tmp_path, config=config, max_steps=3))
    resumed = train(tiny_run(tmp_path, config=config))
    assert resumed.resumed_from == 3 and resumed.finished


def test_a_config_json_cannot_encode_is_refused_at_construction(tmp_path: Path) -> None:
    for bad, where in (({"dtype": torch.float32}, "dtype"), ({"path": Path("/x")}, "path"),
                       ({"ok": [1, {"deep": object()}]}, "deep")):
        with pytest.raises(ValueError, match=where):
            tiny_run(tmp_path, config=bad)
    assert not tmp_path.joinpath("checkpoints").exists()


# 2. a Stateful whose state weights_only cannot load
class NumpyStats:
    def __init__(self) -> None:
        self.mean = np.float64(0.5)

    def state_dict(self) -> dict:
        return {"mean": self.mean}

    def load_state_dict(self, state: dict) -> None:
        self.mean = state["mean"]


def test_a_state_that_could_never_be_loaded_fails_at_the_first_save(tmp_path: Path) -> None:
    with pytest.raises(ResumableError, match="'stats'.*weights_only"):
        train(tiny_run(tmp_path, objects={"stats": NumpyStats()}, checkpoint_steps=1))
    assert newest(tmp_path) is None, "nothing that cannot be resumed is committed"


# 9. snapshot buffers keyed by structure; containers keep their type (async saves only used to lose it)
def test_snapshot_keys_never_collide_and_containers_keep_their_type() -> None:
    point = collections.namedtuple("Point", "x y")
    ordered = collections.OrderedDict(w=torch.ones(2))
    ordered._metadata = {"": {"version": 2}}
    state = {0: torch.zeros(2), "0": torch.ones(2), "a/b": torch.full((2,), 2.0), "a": {"b": torch.full((2,), 3.0)},
             "ordered": ordered, "point": point(torch.full((1,), 4.0), 5)}
    snapshotter = Snapshotter()
    for _ in range(2):  # the second snapshot reuses the buffers of the first
        copy = snapshotter.take(state)
        assert copy[0].tolist() == [0.0, 0.0] and copy["0"].tolist() == [1.0, 1.0]
        assert copy["a/b"].tolist() == [2.0, 2.0] and copy["a"]["b"].tolist() == [3.0, 3.0]
        assert type(copy["ordered"]) is collections.OrderedDict and copy["ordered"]._metadata == ordered._metadata
        assert type(copy["point"]) is point and copy["point"].y == 5 and copy["point"].x.tolist() == [4.0]


# 8. the snapshot synchronises every device it copied from, not only the current one
def test_snapshot_synchronises_every_device_a_tensor_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, source, non_blocking=False: self)  # no real copy
    state = {"a": torch.empty(2, device="meta"), "b": torch.empty(3, device="meta"), "c": torch.zeros(1)}
    Snapshotter(synchronize=synced.append).take(state)
    assert synced == [torch.device("meta")], "each non-CPU device is synchronised once, CPU never"


# 13. evaluate() that leaves the model in eval mode
def test_training_after_evaluate_is_in_train_mode_and_resumes_identically(tmp_path: Path) -> None:
    def evaluate(run_holder: list) -> dict:
        run_holder[0].model.eval()  # and forgets model.train()
        return {"test_acc": 0.5}

    modes: list[bool] = []

    def make(run_dir: Path, **options) -> Run:
        holder: list = []
        run = tiny_run(run_dir, evaluate=lambda: evaluate(holder), **options)
        holder.append(run)
        return run

    train(make(tmp_path / "ref"), lambda run, epoch, step: modes.append(run.model.training))
    assert all(modes), "every step trains in train mode (dropout on), also after evaluate()"
    train(make(tmp_path / "run", max_steps=7))  # stops in the second epoch, after an evaluate
    train(make(tmp_path / "run"))
    assert newest(tmp_path / "run").fingerprint == newest(tmp_path / "ref").fingerprint


# 14. determinism switches recorded; a difference on resume is named
def test_determinism_settings_are_recorded_and_a_change_is_named(tmp_path: Path, capsys) -> None:
    train(tiny_run(tmp_path, max_steps=2))
    assert newest(tmp_path).manifest["determinism"]["cudnn_benchmark"] is False
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        capsys.readouterr()
        train(tiny_run(tmp_path, max_steps=3))
    finally:
        torch.backends.cudnn.benchmark = before
    assert "cudnn_benchmark: checkpoint False, now True" in capsys.readouterr().err


# 15. generators of the user's own in objects=
def test_user_generators_in_objects_resume_exactly(tmp_path: Path) -> None:
    def run_with(run_dir: Path, draws: list, **options) -> Run:
        gens = {"torch_gen": torch.Generator().manual_seed(1), "numpy_gen": np.random.default_rng(2),
                "py_random": random.Random(3)}

        def draw(run, epoch, step) -> None:
            draws.append((torch.rand(1, generator=gens["torch_gen"]).item(), float(gens["numpy_gen"].random()),
                          gens["py_random"].random()))

        return train(tiny_run(run_dir, objects=gens, checkpoint_steps=1, **options), draw)

    straight: list = []
    run_with(tmp_path / "ref", straight)
    interrupted: list = []
    run_with(tmp_path / "run", interrupted, max_steps=4)
    run_with(tmp_path / "run", interrupted)
    assert interrupted == straight and len(straight) == 10


def test_an_object_without_state_is_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="objects\\['counter'\\]"):
        tiny_run(tmp_path, objects={"counter": 3})


# 17b. a lost lock stops training and nothing more is written
def test_losing_the_lock_stops_training_and_writes_nothing_more(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from resumable.engine.rundir import lock as lock_module

    monkeypatch.setattr(lock_module.RunLock.__init__, "__defaults__", (0.05, 180.0))  # a fast heartbeat
    taken = {}

    def take_over(run, epoch, step) -> None:
        if step == 2 and not taken:
            record = {"pid": 1, "host": "another-host", "token": "theirs", "heartbeat": time.time()}
            (tmp_path / "lock.json").write_text(json.dumps(record))
            taken["step"] = step
        # After the take-over, a step lasts two heartbeats: a loaded machine (CI on 2 cores) still notices the loss
        # within a step or two, so the bound below is about the engine, not about scheduling.
        time.sleep(0.1 if taken else 0.02)

    run = train(tiny_run(tmp_path, checkpoint_steps=1, epochs=20), take_over)
    assert not run.finished and run.exit_code == 75 and run.outcome.reason == "lock lost"
    assert newest(tmp_path).step <= 4, "no checkpoint long after the lock was lost"
    assert json.loads((tmp_path / "lock.json").read_text())["token"] == "theirs", "the new owner's lock stays"


# 17d. a Drive restore writes into the local cache only under its lock
def test_a_drive_restore_waits_for_the_lock_of_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mount = tmp_path / "drive"
    monkeypatch.setenv("RESUMABLE_DRIVE_MOUNT", str(mount))
    run_dir = mount / "MyDrive" / "own"
    train(tiny_run(run_dir, cache_dir=str(tmp_path / "vm1"), max_steps=4))
    cache = open_run_location(str(run_dir), str(tmp_path / "vm2")).local_dir
    cache.mkdir(parents=True)
    (cache / "metrics.jsonl").write_text('{"step": 1, "mine": true}\n')
    from resumable.engine.rundir.lock import RunLock

    holder = RunLock(cache)
    holder.acquire()  # a live trainer of this cache (this process)
    try:
        with pytest.raises(RunDirInUse):
            train(tiny_run(run_dir, cache_dir=str(tmp_path / "vm2")))
    finally:
        holder.release()
    assert (cache / "metrics.jsonl").read_text() == '{"step": 1, "mine": true}\n', "the live run's log is untouched"
    assert not checkpoints_dir(cache).exists()


# 17f. a second Ctrl-C does not wait for Drive uploads
def test_a_second_ctrl_c_does_not_wait_for_drive_uploads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from resumable.storage import mounted

    mount = tmp_path / "drive"
    monkeypatch.setenv("RESUMABLE_DRIVE_MOUNT", str(mount))
    real_put = mounted.MountedDirStore.put_file

    def slow_put(self, folder, name, source):
        time.sleep(1.0)
        return real_put(self, folder, name, source)

    monkeypatch.setattr(mounted.MountedDirStore, "put_file", slow_put)
    run = tiny_run(mount / "run", cache_dir=str(tmp_path / "cache"), checkpoint_steps=1, drive_flush_timeout="60s")

    def ctrl_c_twice(run, epoch, step) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the first asks for a clean stop
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGINT)  # the second means "now"
            time.sleep(1.0)

    with pytest.raises(KeyboardInterrupt):
        train(run, ctrl_c_twice)
    started = time.monotonic()
    run.close()  # what a notebook re-run or the interpreter's exit does with the abandoned loop
    assert time.monotonic() - started < 3.0, "the interrupted run waited for its uploads to Drive"
    cache = open_run_location(str(mount / "run"), str(tmp_path / "cache")).local_dir
    assert newest(cache).step >= 3, "the local checkpoints are all there"


# 10. run ids: a stale cache of an old run never beats (or prunes) the newer run on Drive
def test_a_stale_cache_of_an_old_run_yields_to_the_new_run_on_drive(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    mount = tmp_path / "drive"
    monkeypatch.setenv("RESUMABLE_DRIVE_MOUNT", str(mount))
    run_dir = mount / "MyDrive" / "own"
    old = train(tiny_run(run_dir, cache_dir=str(tmp_path / "vm1"), max_steps=8, checkpoint_steps=2))
    assert old.exit_code == 0
    fresh = tiny_run(run_dir, cache_dir=str(tmp_path / "vm2"), max_steps=3, resume="never", overwrite=True)
    assert train(fresh).finished
    on_drive = newest(run_dir).manifest
    back = train(tiny_run(run_dir, cache_dir=str(tmp_path / "vm1"), max_steps=6))  # the first VM's stale cache
    assert back.resumed_from == 3, "the run on Drive (step 3 of the new run) wins over the cache's step 8"
    runs = {i.manifest["run_id"] for i in CheckpointManager(checkpoints_dir(run_dir)).inspect() if i.valid}
    assert runs == {on_drive["run_id"]} and newest(run_dir).step == 6


# 17e. persistent_workers=True keeps the same worker processes across epochs
class PidData(torch.utils.data.Dataset):
    """Samples that say which process loaded them, with an augmentation drawn in that process."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int):
        return torch.tensor([float(index)]) + 0.1 * torch.randn(1), torch.tensor(os.getpid())


def test_persistent_workers_persist_across_epochs_and_change_nothing(tmp_path: Path) -> None:
    def run(run_dir: Path, persistent: bool) -> tuple[set[int], str]:
        torch.manual_seed(0)
        model = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        pids: list[set[int]] = []
        resumable_run = Run(run_dir, model=model, optimizer=optimizer, data=PidData(), batch_size=6, epochs=3,
                            loader=Loader(num_workers=1, options={"persistent_workers": persistent}),
                            reporting=Reporting(progress=False))
        for epoch, _step, (x, pid) in resumable_run:
            if len(pids) <= epoch:
                pids.append(set())
            pids[epoch] |= set(pid.tolist())
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return set.union(*pids) if persistent else pids, newest(run_dir).fingerprint

    persistent_pids, persistent_fp = run(tmp_path / "persistent", True)
    fresh_pids, fresh_fp = run(tmp_path / "fresh", False)
    assert len(persistent_pids) == 1, "one worker process served all three epochs"
    assert len(set.union(*fresh_pids)) == 3, "without persistent_workers each epoch has its own worker"
    assert persistent_fp == fresh_fp, "the same batches and augmentations either way"
