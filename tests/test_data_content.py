"""Verification proves the data by content (engine/data/content_check.py): every checkpoint records what the data
produces next, and the first batch after a resume must be that batch. A stream whose state_dict() does not hold its
exact position (a Hugging Face stream shuffled through a buffer) is resumed by replay instead, exactly; one that resumes
elsewhere is stopped before anything is trained; one whose position does not load is a resume error naming it."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import env, final_fingerprint, records

from resumable import Checkpointing, Loader, Reporting, Run, Session
from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.errors import ResumeNotApplied
from resumable.faults import Faults

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, never the hub
import stream_train  # noqa: E402 - after the variable above

SCRIPT = Path(__file__).with_name("stream_train.py")


def _script(run_dir: Path, kind: str, workers: int, faults: Faults | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(run_dir), kind, str(workers)], capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env=env(HF_DATASETS_OFFLINE="1", **(faults.to_env() if faults else {})))


def _in_process(run_dir: Path, kind: str, workers: int) -> tuple[int, str]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = stream_train.main([str(run_dir), kind, str(workers)])
    return code, stderr.getvalue()


# Before: 0 workers lost and repeated samples in silence (other final weights), 2 workers died inside datasets with
# an IndexError in load_state_dict at the first resume. 2 workers: each replays its own shards.
@pytest.mark.parametrize("workers", [0, 2])
def test_a_buffer_shuffled_hf_stream_resumes_exactly_by_replay(tmp_path: Path, workers: int) -> None:
    pytest.importorskip("datasets")
    killed = _script(tmp_path / "run", "hfshuffle", workers, Faults(kill_at_step=8))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "resumed by replaying its epoch" in killed.stderr and "buffer of 32 samples" in killed.stderr
    code, resumed = _in_process(tmp_path / "run", "hfshuffle", workers)
    assert code == 0, resumed[-3000:]
    assert "resuming from step 6 (epoch 0, batch 6)" in resumed
    assert "replaying 6 batch(es)" in resumed
    assert "the first batch is compared with the checkpoint's record of its batch content" in resumed
    code, reference = _in_process(tmp_path / "ref", "hfshuffle", workers)
    assert code == 0, reference[-3000:]
    assert final_fingerprint(tmp_path / "run") == final_fingerprint(tmp_path / "ref")
    assert records(tmp_path / "run") == records(tmp_path / "ref")


class ResumesElsewhere(stream_train.Stateful):
    """A state_dict protocol that resumes one sample further on, as a refilled buffer does."""

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = state["pos"] + 1


class CannotLoad(stream_train.Stateful):
    def load_state_dict(self, state: dict[str, int]) -> None:
        raise IndexError("list index out of range")


def _train(run_dir: Path, data: object, workers: int, max_steps: int | None = None) -> Run:
    torch.manual_seed(0)
    model = stream_train.Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = Run(run_dir, model=model, optimizer=optimizer, data=data, batch_size=8, epochs=1,
              loader=Loader(num_workers=workers, collate_fn=stream_train.pad),
              checkpointing=Checkpointing(steps=3, synchronous=True), session=Session(max_steps=max_steps),
              reporting=Reporting(progress=False))
    with contextlib.redirect_stderr(io.StringIO()):
        for _epoch, _step, batch in run:
            loss = F.cross_entropy(model(batch["x"], batch["mask"]), batch["y"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return run


def test_a_stream_that_resumes_elsewhere_is_stopped_before_anything_is_trained(tmp_path: Path) -> None:
    # Before: its position record compared with itself, "data position verified", and the run trained on.
    _train(tmp_path, stream_train.Stateful(), 0, max_steps=5)
    manager = CheckpointManager(checkpoints_dir(tmp_path))
    assert manager.latest_valid()[0].step == 5
    with pytest.raises(ResumeNotApplied, match=r"the data \(ResumesElsewhere\) produced another batch at epoch 0, "
                                               r"batch 5.*batch content"):
        _train(tmp_path, ResumesElsewhere(), 0)
    assert [s for s, _ in manager.step_dirs()] == [3, 5]  # nothing new


@pytest.mark.parametrize("workers", [0, 2])
def test_a_position_that_does_not_load_is_a_resume_error_naming_the_data(tmp_path: Path, workers: int) -> None:
    # Before: the dataset's IndexError, raised inside a DataLoader worker, reached the user as it was.
    _train(tmp_path, stream_train.Stateful(), workers, max_steps=5)
    with pytest.raises(ResumeNotApplied, match=r"the data \(CannotLoad, worker \d\) could not resume at its saved "
                                               r"position \(IndexError: list index out of range\)"):
        _train(tmp_path, CannotLoad(), workers)
    assert CheckpointManager(checkpoints_dir(tmp_path)).latest_valid()[0].step == 5
