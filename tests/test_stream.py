"""Iterable data (engine/data/stream.py), killed with SIGKILL mid-epoch and resumed: the same final state and the same
loss at every step as an uninterrupted run, with and without the state_dict protocol, with 0 and 2 workers; a
Hugging Face ``datasets`` stream over local files and torchdata's StatefulDataLoader the same way; and chains of
kills, one on the very first step after a resume and one inside a save."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import final_fingerprint, records, train_script

from resumable import Loader, Reporting, Run
from resumable.errors import ResumableError
from resumable.faults import Faults

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, never the hub
import stream_train  # noqa: E402 - after the variable above

SCRIPT = Path(__file__).with_name("stream_train.py")


def _train(run_dir: Path, kind: str, workers: int, *, faults: Faults | None = None, max_steps: int | None = None
           ) -> subprocess.CompletedProcess:
    args = [str(run_dir), kind, str(workers), *([str(max_steps)] if max_steps is not None else [])]
    # in this process (fast); a session that is killed runs as its own process
    return train_script(SCRIPT, stream_train.main, args, faults, HF_DATASETS_OFFLINE="1")


def _killed(run_dir: Path, kind: str, workers: int, faults: Faults) -> str:
    done = _train(run_dir, kind, workers, faults=faults)
    assert done.returncode == -signal.SIGKILL, f"the kill must land:\n{done.stderr[-3000:]}"
    return done.stderr


def _finish(run_dir: Path, kind: str, workers: int) -> str:
    done = _train(run_dir, kind, workers)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _same_as_reference(tmp_path: Path, kind: str, workers: int) -> None:
    reference = tmp_path / "ref"
    assert _train(reference, kind, workers).returncode == 0
    assert final_fingerprint(tmp_path / "run") == final_fingerprint(reference)
    steps = records(tmp_path / "run")
    assert steps == records(reference)
    assert sum("loss" in r for r in steps) >= 30  # a loss at every step of both epochs


# The replayed stream and the HF stream with workers run in the soak set: the replay is the one of ("plain", 0),
# the HF adapter the one of ("hf", 0), and the per-worker positions those of ("stateful", 2).
KINDS = [("plain", 0), pytest.param("plain", 2, marks=pytest.mark.soak), ("stateful", 0), ("stateful", 2),
         ("hf", 0), pytest.param("hf", 2, marks=pytest.mark.soak), ("loader", 2)]


@pytest.mark.parametrize(("kind", "workers"), KINDS)
def test_sigkill_mid_epoch_resumes_identically(tmp_path: Path, kind: str, workers: int) -> None:
    if kind == "hf":
        pytest.importorskip("datasets")
    if kind == "loader":
        pytest.importorskip("torchdata")
    _killed(tmp_path / "run", kind, workers, Faults(kill_at_step=8))  # mid-epoch 0, after the checkpoint of step 6
    resumed = _finish(tmp_path / "run", kind, workers)
    assert "resuming from step 6 (epoch 0, batch 6)" in resumed
    assert "resume verified in" in resumed and "data position (epoch 0, batch 6)" in resumed
    replayed = "replaying" in resumed
    assert replayed == (kind == "plain"), resumed  # only a stream without the protocol replays
    _same_as_reference(tmp_path, kind, workers)


# Soak set (about 30 s each): the default run kills a stream mid-epoch above, and kills map-style data on the first
# step after a resume and inside a save (test_chaos.py, test_kill.py) through the same engine paths.
@pytest.mark.soak
@pytest.mark.parametrize(("kind", "workers"), [("stateful", 2), ("plain", 2)])
def test_three_chained_kills_the_first_on_the_step_right_after_a_resume(tmp_path: Path, kind: str,
                                                                         workers: int) -> None:
    run_dir = tmp_path / "run"
    assert _train(run_dir, kind, workers, max_steps=5).returncode == 0  # ends at step 5, committed
    stderr = _killed(run_dir, kind, workers, Faults(kill_at_step=6))  # 1: the first step after that resume
    assert "resuming from step 5" in stderr
    stderr = _killed(run_dir, kind, workers, Faults(kill_at_step=11))  # 2: mid-epoch, after step 9's checkpoint
    assert "resuming from step 5" in stderr  # nothing was saved by the session killed at its first step
    stderr = _killed(run_dir, kind, workers, Faults(kill_in_save_at_step=18))  # 3: inside a save, in epoch 1
    assert "resuming from step 9" in stderr
    stderr = _finish(run_dir, kind, workers)
    assert "resuming from step 16" in stderr  # epoch 0 ended at 16 (its checkpoint), step 18's never committed
    _same_as_reference(tmp_path, kind, workers)


def test_an_iterator_or_a_stream_under_the_wrong_options_is_refused(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="sampler= is decided by resumable"):
        Run(tmp_path, model=model, optimizer=optimizer, data=stream_train.Stateful(), batch_size=4,
            loader=Loader(options={"sampler": []}))
    loader = torch.utils.data.DataLoader(stream_train.Stateful(), batch_size=4)
    with pytest.raises(ValueError, match="batch_size=8 but the loader makes batches of 4"):
        Run(tmp_path, model=model, optimizer=optimizer, data=loader, batch_size=8)
    with pytest.raises(ValueError, match="num_workers belong to it"):
        Run(tmp_path, model=model, optimizer=optimizer, data=loader, batch_size=4, loader=Loader(num_workers=2))


def test_resuming_with_other_workers_names_the_difference(tmp_path: Path) -> None:
    _killed(tmp_path / "run", "stateful", 2, Faults(kill_at_step=8))
    with pytest.raises(ResumableError, match=r"num_workers: checkpoint 2, now 0\).*per DataLoader worker"):
        _train(tmp_path / "run", "stateful", 0)


def test_the_progress_bar_runs_before_the_stream_length_is_known(tmp_path: Path) -> None:
    model = stream_train.Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = Run(tmp_path, model=model, optimizer=optimizer, data=stream_train.Stateful(), batch_size=8, epochs=1,
              loader=Loader(collate_fn=stream_train.pad), reporting=Reporting(progress=True))
    assert sum(1 for _ in run) == 15 and run.finished
