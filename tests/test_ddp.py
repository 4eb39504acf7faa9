"""DDP under torchrun (gloo, 2 CPU processes): sharding, a worker killed and restarted by torchrun, a signal on
one rank, and resuming a 2-rank checkpoint with one process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import env, final_fingerprint, records, small_filesystem

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.engine.data.sampler import ResumableSampler

BIN = Path(sys.executable).parent
TRAIN = ["--device", "cpu", "--max-steps", "40", "--checkpoint-steps", "5", "--batch-size", "64", "--log-every", "1",
         "--no-progress", "--no-download"]


@pytest.mark.parametrize(("size", "batch", "world"), [(1000, 64, 2), (1000, 64, 3), (130, 64, 2), (7, 2, 2)])
def test_ranks_share_each_epoch_without_overlap_in_the_single_process_order(size: int, batch: int,
                                                                            world: int) -> None:
    single = ResumableSampler(size, batch * world, seed=5)
    ranks = [ResumableSampler(size, batch, seed=5, rank=r, world_size=world) for r in range(world)]
    # A last step that would leave a rank fewer than 2 samples is not taken under DDP ((130, 64, 2): 2 left;
    # (7, 2, 2): 3 left); the steps taken are the single-process ones, in its order.
    dropped = ranks[0].dropped_per_epoch
    assert dropped == {(130, 64, 2): 2, (7, 2, 2): 3}.get((size, batch, world), 0)
    assert ranks[0].batches_per_epoch == single.batches_per_epoch - (1 if dropped else 0)
    for epoch in (0, 3):
        order = single.epoch_order(epoch)
        steps = [torch.cat([s.batch(order, k) for s in ranks]) for k in range(ranks[0].batches_per_epoch)]
        assert torch.equal(torch.cat(steps), order[:size - dropped]), "rank slices in rank order: single-process order"
        for k in range(ranks[0].batches_per_epoch):
            assert torch.equal(steps[k], single.batch(order, k))


def _torchrun(run_dir: Path, data: Path, *extra: str, restarts: int = 0) -> subprocess.Popen:
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts),
               str(BIN / "resumable-train"), "--run-dir", str(run_dir), "--data-dir", str(data), *TRAIN, *extra]
    return subprocess.Popen(command, env=env(OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)


def _worker(agent: subprocess.Popen, rank: int, timeout: float = 60) -> int:
    """The pid of the worker process of ``rank`` (a child of the torchrun agent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{agent.pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                try:
                    environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RUN_ID=" in b" ".join(environ):
                    return int(child)
        time.sleep(0.05)
    raise AssertionError(f"no worker of rank {rank} under torchrun pid {agent.pid}")


def _steps(run_dir: Path) -> list[int]:
    return [i.step for i in CheckpointManager(checkpoints_dir(run_dir)).inspect(deep=False) if i.valid]


def _wait_for_checkpoint(run_dir: Path, agent: subprocess.Popen, at_least: int) -> None:
    deadline = time.monotonic() + 120
    while agent.poll() is None and time.monotonic() < deadline:
        steps = _steps(run_dir)
        if steps and steps[-1] >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint >= {at_least} in {run_dir}")


@pytest.fixture(scope="module")
def reference(mnist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("ddp") / "reference"
    agent = _torchrun(run_dir, mnist_dir)
    _, stderr = agent.communicate(timeout=300)
    assert agent.returncode == 0, stderr[-3000:]
    assert "rank 1 of 2" in stderr
    return run_dir


def test_killed_worker_is_restarted_by_torchrun_and_resumes_identically(reference: Path, mnist_dir: Path,
                                                                         tmp_path: Path) -> None:
    agent = _torchrun(tmp_path, mnist_dir, restarts=1)
    _wait_for_checkpoint(tmp_path, agent, 10)
    os.kill(_worker(agent, 1), signal.SIGKILL)
    _, stderr = agent.communicate(timeout=300)
    assert agent.returncode == 0, stderr[-3000:]
    assert "resuming from step" in stderr, "torchrun restarted the group, which resumed"
    assert final_fingerprint(tmp_path) == final_fingerprint(reference)
    assert records(tmp_path) == records(reference)


def test_a_signal_on_one_rank_stops_all_at_one_step_and_resumes_identically(reference: Path, mnist_dir: Path,
                                                                            tmp_path: Path) -> None:
    agent = _torchrun(tmp_path, mnist_dir)
    _wait_for_checkpoint(tmp_path, agent, 5)
    os.kill(_worker(agent, 1), signal.SIGTERM)
    _, stderr = agent.communicate(timeout=300)
    stopped = [line for line in stderr.splitlines() if "stopped early" in line]
    assert len(stopped) == 1, stderr[-3000:]  # rank 0 reports; both ranks exited 75 at the same step
    latest, _ = CheckpointManager(checkpoints_dir(tmp_path)).latest_valid()
    assert f"state committed at step {latest.step}" in stopped[0] and latest.step < 40
    assert latest.manifest["reason"] == "signal on another rank" and latest.manifest["world_size"] == 2
    again = _torchrun(tmp_path, mnist_dir)
    _, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr[-3000:]
    assert final_fingerprint(tmp_path) == final_fingerprint(reference)
    assert records(tmp_path) == records(reference)


# The soak set only, to keep the default run short: test_ddp_fixes.py's SIGTERM to the launcher takes the same path
# (torchrun passes the signal on to each worker's process group; every rank commits at one step; exit 75).
@pytest.mark.soak
def test_ctrl_c_in_a_terminal_stops_torchrun_and_its_workers_cleanly(reference: Path, mnist_dir: Path,
                                                                    tmp_path: Path) -> None:
    """Ctrl-C reaches the launcher (the terminal's process group); torchrun passes SIGINT on to each worker's own
    process group. Every rank commits at one step, the launcher exits 75, and the same command finishes the run."""
    command = [str(BIN / "resumable"), "torchrun", "--standalone", "--nproc-per-node", "2",
               str(BIN / "resumable-train"), "--run-dir", str(tmp_path), "--data-dir", str(mnist_dir), *TRAIN]
    agent = subprocess.Popen(command, env=env(OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    _wait_for_checkpoint(tmp_path, agent, 5)
    os.killpg(agent.pid, signal.SIGINT)
    _, stderr = agent.communicate(timeout=300)
    assert agent.returncode == 75, stderr[-3000:]
    assert "stopped early (SIGINT)" in stderr and "Traceback" not in stderr, stderr[-3000:]
    again = subprocess.run(command, env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL)
    assert again.returncode == 0, again.stderr[-3000:]
    assert final_fingerprint(tmp_path) == final_fingerprint(reference)
    assert records(tmp_path) == records(reference)


def test_one_process_resumes_a_two_rank_checkpoint_with_a_warning(mnist_dir: Path, tmp_path: Path) -> None:
    agent = _torchrun(tmp_path, mnist_dir, "--max-steps", "12")
    _, stderr = agent.communicate(timeout=300)
    assert agent.returncode == 0, stderr[-3000:]
    single = subprocess.run([str(BIN / "resumable-train"), "--run-dir", str(tmp_path), "--data-dir", str(mnist_dir),
                             *TRAIN, "--max-steps", "20"], capture_output=True, text=True, env=env(), timeout=300)
    assert single.returncode == 0, single.stderr
    assert "written by 2 process(es), this run has 1" in single.stderr
    assert "epoch 1 goes on at sample 1536 of 8000 (none skipped or trained twice)" in single.stderr
    assert _steps(tmp_path)[-1] == 20


def test_a_failed_save_on_rank_0_stops_every_rank_without_a_hang(mnist_dir: Path, tmp_path: Path) -> None:
    # A real 20 MB disk holds one checkpoint (14 MB) but not two: the second save fails with ENOSPC on rank 0,
    # the only rank that writes. The other rank must learn of it, stop at the same step and never wait in a
    # collective that rank 0 skipped.
    with small_filesystem(tmp_path / "disk", "20m") as disk:
        run_dir = disk / "run"
        agent = _torchrun(run_dir, mnist_dir, "--on-save-error", "stop", "--keep", "1", "--no-keep-best")
        try:
            _, stderr = agent.communicate(timeout=180)
        finally:
            agent.kill()
        assert agent.returncode != 0, stderr[-3000:]
        assert "No space left on device" in stderr and "Stopping (--on-save-error stop)" in stderr, stderr[-3000:]
        assert "stopped early (a checkpoint could not be written): the newest valid checkpoint is step 5" in stderr
        assert _steps(run_dir) == [5]


def test_the_ddp_model_is_freed_before_the_process_group_is_destroyed(mnist_dir: Path, tmp_path: Path) -> None:
    # A DDP model still alive when its gloo group is destroyed is freed at interpreter teardown, where gloo's
    # destructor can abort a run that ended cleanly (seen once in CI: SIGABRT after "done at step 40").
    script = tmp_path / "probe.py"
    script.write_text(
        "import gc, sys\n"
        "from torch.nn.parallel import DistributedDataParallel\n"
        "from resumable import distributed\nfrom resumable.tasks import train_mnist as runner\n"
        "close = distributed.Distributed.close\n"
        "def probe(self):\n"
        "    alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())\n"
        "    print(f'rank {self.rank}: {alive} DDP alive', file=sys.stderr)\n"
        "    close(self)\n"
        "distributed.Distributed.close = probe\n"
        f"result = runner.train({{'run_dir': {str(tmp_path / 'run')!r}, 'data_dir': {str(mnist_dir)!r}, "
        "'device': 'cpu', 'max_steps': 4, 'batch_size': 64, 'progress': False, 'download': False})\n"
        "sys.exit(result.exit_code)\n")
    agent = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(script)],
                           env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL)
    assert agent.returncode == 0, agent.stderr[-3000:]
    assert "rank 0: 0 DDP alive" in agent.stderr and "rank 1: 0 DDP alive" in agent.stderr, agent.stderr[-3000:]
