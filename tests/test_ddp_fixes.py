"""DDP regressions: the step decision is not a host sync per step, the one-cycle schedule is as long as the DDP
run, every rank agrees on a failed load, per-rank loss sums survive a mid-epoch resume, and a stop on purpose
under torchrun ends the group (exit 75 through `resumable torchrun`) instead of being restarted."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import env, records

from resumable.checkpoint.writer import SaveStats
from resumable.distributed import Distributed
from resumable.engine.data.sampler import ResumableSampler
from resumable.engine.loop.evaluation import Evaluator
from resumable.engine.loop.plan import LoopPlan
from resumable.engine.loop.torchrun_stop import (
    STOPPED,
    PlannedStop,
    planned_stop_before_restart,
    read_planned_stop,
    record_planned_stop,
    write_planned_stop,
)
from resumable.engine.loop.training_loop import Loop
from resumable.engine.loop.triggers import SaveTriggers
from resumable.engine.state.train_state import TrainState
from resumable.faults import NO_FAULTS
from resumable.reporting.history import read_sessions
from resumable.reporting.reporters import Reporter

BIN = Path(sys.executable).parent
FLAGS = ("save error", "lock lost", "signal", "time limit", "due")  # Loop._boundary's flags, in order


# -- (17h) the per-step decision is asynchronous ----------------------------------------------------------------
class _Writer:
    asynchronous = False

    def __init__(self) -> None:
        self.stats = SaveStats()

    def check(self) -> None: ...

    def wait(self, on_wait=None) -> None: ...  # noqa: ANN001


class _Manager:
    def latest_valid(self) -> tuple[None, list]:
        return None, []


class _Session:
    """The part of a StateKeeper the loop touches; records each save's step and reason."""

    def __init__(self) -> None:
        self.state = TrainState()
        self.writer = _Writer()
        self.manager = _Manager()
        self.last_saved_step: int | None = None
        self.saves: list[tuple[int, str]] = []
        self.faults = NO_FAULTS

    def save(self, reason: str, metrics: dict | None = None, blocked_since: float | None = None) -> None:
        self.saves.append((self.state.step, reason))
        self.last_saved_step = self.state.step

    def wait_shards(self) -> None: ...  # no sharded model here


class _Pending:
    def __init__(self, dist: _FakeDist, issued: int, values: list[bool]) -> None:
        self.dist, self.issued, self.values = dist, issued, values

    def result(self) -> list[bool]:
        self.dist.events.append(("result", self.issued, self.dist.step()))
        return self.values


class _FakeDist:
    """Rank 0 of 2: records every collective with the step it happens at; ``remote`` adds another rank's flags
    to the reduction started at a given step."""

    rank, world_size, local_rank = 0, 2, 0
    active, main = True, True

    def __init__(self, remote: dict[int, dict[str, bool]] | None = None) -> None:
        self.events: list[tuple] = []
        self.remote = remote or {}
        self.step = lambda: -1

    def _reduce(self, flags: list[bool]) -> list[bool]:
        other = self.remote.get(self.step(), {})
        return [f or other.get(name, False) for f, name in zip(flags, FLAGS, strict=True)]

    def any(self, flags: list[bool], device: torch.device) -> list[bool]:
        self.events.append(("any", self.step()))
        return self._reduce(flags) if len(flags) == len(FLAGS) else flags

    def any_async(self, flags: list[bool], device: torch.device) -> _Pending:
        self.events.append(("async", self.step()))
        return _Pending(self, self.step(), self._reduce(flags))

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        return values


class _EveryNSteps:
    """A wall-clock-like trigger (it keeps firing until a save happens): due once ``n`` steps passed since the
    last save, like ``--checkpoint-every`` with steps of equal length."""

    def __init__(self, n: int, session: _Session) -> None:
        self.n, self.session, self.last = n, session, 0

    def due(self, step: int) -> str | None:
        return "time" if step - self.last >= self.n else None

    def saved(self, cost_s: float) -> None:
        self.last = self.session.state.step


def _drive(dist: Any, epochs: int = 1, triggers: Any = None, session: _Session | None = None,
           batches: int = 6) -> tuple[Loop, _Session]:
    """Train ``batches`` steps an epoch (2 ranks x 4 samples, or 8 in a single process) with a fake step."""
    session = session or _Session()
    world = dist.world_size
    if isinstance(dist, _FakeDist):
        dist.step = lambda: session.state.step
    sampler = ResumableSampler(batches * 8, 8 // world, seed=0, rank=0, world_size=world)
    loop = Loop(session, sampler, LoopPlan(epochs=epochs), Reporter(), Evaluator(None, torch.nn.Linear(1, 1)),
                lambda: 0.1, torch.device("cpu"), triggers=triggers, dist=dist)
    for _epoch, _index, _indices, _last in loop.run():
        loop.report_loss(torch.tensor(0.5))
    return loop, session


def test_within_an_epoch_each_step_decision_is_started_async_and_read_at_the_next_boundary() -> None:
    dist = _FakeDist()
    loop, session = _drive(dist, epochs=2, batches=6)
    assert loop.outcome is not None and loop.outcome.finished and session.state.step == 12
    issued = [step for kind, step, *_ in dist.events if kind == "async"]
    assert issued == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11], "one async decision per step boundary inside an epoch"
    blocking = [step for kind, step, *_ in dist.events if kind == "any"]
    # Blocking reductions only at the start, each epoch end and the end of the run, never per step.
    assert all(step in (0, 6, 12) for step in blocking), blocking
    reads = [(issued_at, read_at) for kind, issued_at, *rest in dist.events if kind == "result"
             for read_at in rest]
    assert [i for i, _ in reads] == issued, "every async decision is consumed"
    for issued_at, read_at in reads:  # at the following boundary (or the epoch's end, before its collectives)
        assert read_at == issued_at + 1, (issued_at, read_at)
    # No async result is read before the step after it is trained.
    order = [(kind, step) for kind, step, *_ in dist.events]
    assert order.index(("async", 1)) < order.index(("result", 1)) and ("result", 1) not in order[:2]


def test_a_stop_on_another_rank_lands_one_step_later_on_every_rank() -> None:
    dist = _FakeDist(remote={3: {"signal": True}})
    loop, session = _drive(dist, batches=6)
    assert loop.outcome is not None and not loop.outcome.finished
    assert loop.outcome.reason == "signal on another rank"
    assert session.state.step == 4 and session.saves[-1] == (4, "signal on another rank")


def test_a_step_trigger_saves_at_its_own_step_under_ddp_as_in_a_single_process() -> None:
    # --checkpoint-steps is the same on every rank: it needs no agreement, so it is not deferred.
    saves = {}
    for name, dist in (("ddp", _FakeDist()), ("single", Distributed())):
        _, session = _drive(dist, triggers=SaveTriggers(every_steps=2, every_s=None), batches=7)
        saves[name] = session.saves
    assert saves["ddp"] == saves["single"] == [(2, "steps"), (4, "steps"), (6, "steps"), (7, "epoch")]


def test_a_wall_clock_trigger_saves_once_per_interval_under_ddp() -> None:
    # The trigger keeps firing until a save happens; deferred by one step, the firing of the step that saves
    # must not ask for a second save at the step after.
    session = _Session()
    _drive(_FakeDist(), triggers=_EveryNSteps(3, session), session=session, batches=12)
    within = [step for step, reason in session.saves if reason == "time"]
    assert within == [4, 8], session.saves  # due at 3 → saved at 4; due at 7 → saved at 8; never at 5 or 9


# -- (4) the one-cycle schedule under torchrun ------------------------------------------------------------------
def test_onecycle_schedule_spans_the_steps_of_a_ddp_run(tiny_mnist: Path) -> None:
    from resumable.config import TrainConfig
    from resumable.tasks.mnist_task import MnistTask

    cfg = TrainConfig(data_dir=str(tiny_mnist), lr_schedule="onecycle", epochs=3, batch_size=10, download=False,
                      device="cpu")
    for world in (1, 2):
        task = MnistTask(cfg, torch.device("cpu"), world_size=world)
        assert task.scheduler.total_steps == 3 * math.ceil(96 / (10 * world)), world


# -- (7) the planned-stop marker ---------------------------------------------------------------------------------
def test_a_planned_stop_marker_is_validated_and_only_honoured_by_a_restart_of_its_own_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    single = Distributed()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not record_planned_stop(single, tmp_path, "time limit", 7), "not under torchrun: exit 75 as always"
    assert not (tmp_path / STOPPED).exists()

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("RESUMABLE_STOP_MARKER", str(tmp_path / "launcher.json"))
    for failure in ("save error", "lock lost"):  # not planned: exit 75, which torchrun counts as a failure
        assert not record_planned_stop(single, tmp_path, failure, 7)
    assert not (tmp_path / STOPPED).exists() and not (tmp_path / "launcher.json").exists()
    assert record_planned_stop(single, tmp_path, "time limit", 7)
    stop = read_planned_stop(tmp_path / STOPPED)
    assert stop is not None and (stop.run_id, stop.reason, stop.step) == ("job-a", "time limit", 7)
    assert read_planned_stop(tmp_path / "launcher.json") == stop
    assert json.loads((tmp_path / STOPPED).read_text())["torchelastic_run_id"] == "job-a"

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the group restarted after a crash: stop at once
    assert planned_stop_before_restart(single, tmp_path) == stop
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")  # another job (same --rdzv-id reused is caught below)
    assert planned_stop_before_restart(single, tmp_path) is None
    assert not (tmp_path / STOPPED).exists(), "a session that trains removes the older marker"

    write_planned_stop(tmp_path / STOPPED, stop)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a new launch that reuses the run id trains
    assert planned_stop_before_restart(single, tmp_path) is None and not (tmp_path / STOPPED).exists()

    for bad in ("{", "[]", '{"torchelastic_run_id": "job-a", "reason": "x", "step": -1, "time": 0}',
                '{"torchelastic_run_id": "", "reason": "x", "step": 1, "time": 0}'):
        (tmp_path / STOPPED).write_text(bad)
        assert read_planned_stop(tmp_path / STOPPED) is None, bad
    (tmp_path / STOPPED).unlink()
    (tmp_path / "elsewhere.json").write_text(json.dumps(stop.to_json()))
    (tmp_path / STOPPED).symlink_to(tmp_path / "elsewhere.json")
    assert read_planned_stop(tmp_path / STOPPED) is None, "a link is not followed"
    assert PlannedStop.from_json(stop.to_json()) == stop


# -- DDP subprocess tests -----------------------------------------------------------------------------------------
TINY = ["--device", "cpu", "--batch-size", "8", "--log-every", "1", "--no-progress", "--no-download"]


def _torchrun(*args: str, launcher: list[str] | None = None, timeout: float = 180,
              **extra_env: str) -> subprocess.CompletedProcess:
    command = (launcher or [str(BIN / "torchrun")]) + ["--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(command, env=env(OMP_NUM_THREADS="1", **extra_env), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _train(run_dir: Path, data: Path, *extra: str, restarts: int = 0,
           launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    return _torchrun("--max-restarts", str(restarts), str(BIN / "resumable-train"), "--run-dir", str(run_dir),
                     "--data-dir", str(data), *TINY, *extra, launcher=launcher)


def test_a_mid_epoch_ddp_resume_keeps_the_epoch_train_loss(tiny_mnist: Path, tmp_path: Path) -> None:
    # 96 samples in steps of 2 x 8: 6 steps an epoch. Each rank's loss sum and count are its own; before, only
    # rank 0's were saved and every rank got them back, so the resumed epoch's train_loss changed.
    with ThreadPoolExecutor(2) as pool:  # the uninterrupted run and the first session train at the same time
        straight = pool.submit(_train, tmp_path / "straight", tiny_mnist, "--epochs", "1")
        first = pool.submit(_train, tmp_path / "resumed", tiny_mnist, "--epochs", "1", "--max-steps", "3")
        straight, first = straight.result(), first.result()
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(tmp_path / "resumed", tiny_mnist, "--epochs", "1", "--max-steps", "6")
    assert second.returncode == 0 and "resuming from step 3" in second.stderr, second.stderr[-3000:]
    epoch = [r for r in records(tmp_path / "straight") if "train_loss" in r]
    assert len(epoch) == 1
    assert [r for r in records(tmp_path / "resumed") if "train_loss" in r] == epoch
    assert records(tmp_path / "resumed") == records(tmp_path / "straight")


_DENY_WORKER = """
import os, sys, time
import torch
from resumable.checkpoint.manager import CheckpointManager
from resumable.errors import ResumableError
from resumable.tasks import train_mnist

run_dir, data_dir, deny = sys.argv[1], sys.argv[2], sys.argv[3]
rank = int(os.environ["RANK"])
if rank == 1 and deny == "manager":  # rank 1 cannot read the run dir (another user, a mount only rank 0 has)
    def load(self, info, *args, **kwargs):
        raise OSError(13, "Permission denied", str(info.path / "state.pt"))
    CheckpointManager.load = load
if rank == 1 and deny == "payload":
    real = torch.load
    def load(f, *args, **kwargs):
        if os.path.realpath(str(f)).startswith(run_dir):  # the payload is loaded through /proc/self/fd/N
            raise OSError(13, "Permission denied", str(f))
        return real(f, *args, **kwargs)
    torch.load = load
try:
    code = train_mnist.train({"run_dir": run_dir, "data_dir": data_dir, "device": "cpu", "epochs": 2,
                              "batch_size": 8, "progress": False, "download": False}).exit_code
except Exception as e:
    print(f"rank {rank} error: {e}", file=sys.stderr, flush=True)
    code = getattr(e, "exit_code", 1)
    if rank == 1 and deny != "none":
        # Stay in the job, as a notebook kernel that caught the error would (or an NCCL rank, whose peers do
        # not notice its exit): a rank waiting on this one would wait until the group timeout.
        time.sleep(120)
print(f"rank {rank} exits {code}", file=sys.stderr, flush=True)
sys.exit(code)
"""


@pytest.fixture(scope="module")
def denied_run(tiny_mnist: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The worker script and a run dir it trained (2 epochs of 6 steps), shared by both cases below."""
    folder = tmp_path_factory.mktemp("deny")
    script, run_dir = folder / "worker.py", folder / "run"
    script.write_text(_DENY_WORKER)
    made = _torchrun(str(script), str(run_dir), str(tiny_mnist), "none")
    assert made.returncode == 0, made.stderr[-3000:]
    return script, run_dir


@pytest.mark.parametrize("deny", ["manager", "payload"])
def test_a_rank_that_cannot_read_the_checkpoint_fails_every_rank_at_once(tiny_mnist: Path, tmp_path: Path,
                                                                         denied_run: tuple[Path, Path],
                                                                         deny: str) -> None:
    script, run_dir = denied_run[0], tmp_path / "run"
    shutil.copytree(denied_run[1], run_dir, symlinks=True)
    (run_dir / "checkpoints" / "step-000000012" / "manifest.json").unlink()  # so step 6 is resumed
    started = time.monotonic()
    failed = _torchrun(str(script), str(run_dir), str(tiny_mnist), deny, timeout=300)
    took = time.monotonic() - started
    assert took < 60, f"took {took:.0f}s: a rank waited for the one that failed (group timeout)"
    assert failed.returncode != 0
    # every rank stops with the same message naming rank 1 (rank 0 never resumes alone from an older one)
    assert "rank 0 error: rank 1 cannot use checkpoint step 6" in failed.stderr, failed.stderr[-3000:]
    assert "but other ranks can" in failed.stderr
    assert "rank 0 exits 2" in failed.stderr, failed.stderr[-3000:]
    assert "rank 1 error:" in failed.stderr


# -- (7) a stop on purpose under torchrun ----------------------------------------------------------------------
# In the soak set (about 30 s): the planned-stop marker that keeps torchrun from restarting the group is covered by
# test_plain_torchrun_ends_the_group_with_exit_0_on_a_planned_stop and test_a_group_restarted_after_a_planned_stop_
# exits_at_once, and `resumable torchrun`'s exit 75 for it by test_sigterm_to_the_launcher_stops_the_workers_....
@pytest.mark.soak
def test_resumable_torchrun_exits_75_on_a_time_limit_without_a_restart_and_continues(mnist_dir: Path,
                                                                                     tmp_path: Path) -> None:
    # Before, the workers exited 75, torchrun --max-restarts counted that as a failure, restarted the group
    # (which trained on with a fresh budget) and finally exited 1.
    launcher = [str(BIN / "resumable"), "torchrun"]
    args = ["--max-steps", "100", "--batch-size", "64", "--time-limit", "8s"]
    codes = []
    for launch in range(1, 9):
        done = _train(tmp_path, mnist_dir, *args, restarts=2, launcher=launcher)
        codes.append(done.returncode)
        sessions = read_sessions(tmp_path)
        assert len(sessions) == launch, f"launch {launch}: {[s.how for s in sessions]}\n{done.stderr[-3000:]}"
        if done.returncode == 0:
            assert sessions[-1].ended == "finished"
            break
        assert done.returncode == 75, done.stderr[-3000:]
        assert sessions[-1].ended == "time limit" and sessions[-1].end_step < 100
        assert "stopped early (time limit)" in done.stderr and "exit code 75" in done.stderr
        assert read_planned_stop(tmp_path / STOPPED) is not None
    assert codes[0] == 75 and codes[-1] == 0, codes
    assert read_sessions(tmp_path)[-1].end_step == 100
    assert not (tmp_path / STOPPED).exists(), "the session that trained on removed the marker"


def test_plain_torchrun_ends_the_group_with_exit_0_on_a_planned_stop(tiny_mnist: Path, tmp_path: Path) -> None:
    # SIGTERM-like stop on purpose without the launcher: the group ends (no restart) and says how to continue.
    done = _train(tmp_path, tiny_mnist, "--epochs", "3", "--time-limit", "1s", restarts=2)
    assert done.returncode == 0, done.stderr[-3000:]
    sessions = read_sessions(tmp_path)
    assert len(sessions) == 1 and sessions[0].ended == "time limit", [s.how for s in sessions]
    assert "stopped early (time limit)" in done.stderr and "`resumable torchrun`" in done.stderr


_CRASH_AFTER_STOP_WORKER = """
import os, sys
from resumable.tasks import train_mnist

result = train_mnist.train({"run_dir": sys.argv[1], "data_dir": sys.argv[2], "device": "cpu", "epochs": 3,
                            "batch_size": 8, "time_limit": "1s", "progress": False, "download": False})
print(f"rank {os.environ['RANK']} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} exits {result.exit_code}",
      file=sys.stderr, flush=True)
if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    os._exit(1)  # a crash after the planned stop was recorded (e.g. at teardown): torchrun restarts the group
sys.exit(result.exit_code)
"""


def test_a_group_restarted_after_a_planned_stop_exits_at_once(tiny_mnist: Path, tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_CRASH_AFTER_STOP_WORKER)
    run_dir = tmp_path / "run"
    done = _torchrun("--max-restarts", "2", str(script), str(run_dir), str(tiny_mnist),
                     launcher=[str(BIN / "resumable"), "torchrun"])
    assert done.returncode == 75, done.stderr[-3000:]
    assert "rank 0 attempt 1 exits 0" in done.stderr and "rank 1 attempt 1 exits 0" in done.stderr
    assert "stopped on purpose at step" in done.stderr and "not training again" in done.stderr
    sessions = read_sessions(run_dir)
    assert len(sessions) == 1 and sessions[0].ended == "time limit", "the restarted group did not train"


def test_the_launcher_passes_a_failure_through(tiny_mnist: Path, tmp_path: Path) -> None:
    done = _torchrun(str(BIN / "resumable-train"), "--run-dir", str(tmp_path), "--data-dir", str(tmp_path / "none"),
                     *TINY, launcher=[str(BIN / "resumable"), "torchrun"])
    assert done.returncode == 1, done.stderr[-3000:]
    assert "exitcode" in done.stderr


def test_the_launcher_needs_arguments() -> None:
    done = subprocess.run([str(BIN / "resumable"), "torchrun"], capture_output=True, text=True, env=env())
    assert done.returncode == 2 and "torchrun's arguments" in done.stderr


def test_sigterm_to_the_launcher_stops_the_workers_cleanly_and_exits_75(mnist_dir: Path, tmp_path: Path) -> None:
    # A scheduler preempting the job signals the launcher; torchrun passes SIGTERM on to the workers.
    import signal

    from resumable.checkpoint import CheckpointManager, checkpoints_dir

    command = [str(BIN / "resumable"), "torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
               str(BIN / "resumable-train"), "--run-dir", str(tmp_path), "--data-dir", str(mnist_dir),
               *TINY, "--batch-size", "64", "--max-steps", "400", "--checkpoint-steps", "5"]
    launcher = subprocess.Popen(command, env=env(OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while launcher.poll() is None and time.monotonic() < deadline:
            if any(i.valid for i in CheckpointManager(checkpoints_dir(tmp_path)).inspect(deep=False)):
                break
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 75, stderr[-3000:]
    sessions = read_sessions(tmp_path)
    assert len(sessions) == 1 and sessions[0].ended == "SIGTERM" and sessions[0].end_step < 400, stderr[-3000:]
    assert "stopped early (SIGTERM)" in stderr and "a worker failed" not in stderr
