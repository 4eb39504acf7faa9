"""Resume verification (engine/state/verify.py): each planted mistake that makes a resume silently load nothing stops
with an error naming the object, and a correct resume says what it checked and how long it took."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from resumable import Checkpointing, Reporting, Run, Session
from resumable.errors import ResumeNotApplied

DATA = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class IgnoresItsState(Net):
    def load_state_dict(self, state_dict, strict=True, assign=False):  # noqa: ANN001, ANN201 - the planted bug
        return None


def _train(run_dir: Path, model: torch.nn.Module | None = None, *, max_steps: int | None = None,
           pass_scheduler: bool = True, recreate_optimizer: bool = False, scheduler_class=None,  # noqa: ANN001
           scaler=None) -> Run:  # noqa: ANN001
    torch.manual_seed(0)
    model = model or Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = (scheduler_class or torch.optim.lr_scheduler.StepLR)(optimizer, 2, 0.5)
    run = Run(run_dir, model=model, optimizer=optimizer, scheduler=scheduler if pass_scheduler else None, scaler=scaler,
              data=DATA, batch_size=8, epochs=2, checkpointing=Checkpointing(steps=2),
              session=Session(max_steps=max_steps), reporting=Reporting(progress=False))
    if recreate_optimizer:  # the planted bug: the Run restores into the first optimizer, training uses this one
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _epoch, _step, (x, y) in run:
        loss = F.cross_entropy(model(x + 0.01 * torch.randn_like(x)), y)  # draws from the global RNG
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        scheduler.step()
        run.log(loss)
    return run


def test_a_correct_resume_reports_what_it_verified(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _train(tmp_path, max_steps=5)
    capsys.readouterr()
    assert _train(tmp_path).finished
    line = next(x for x in capsys.readouterr().err.splitlines() if "resume verified" in x)
    for checked in ("model + optimizer byte-equal to the checkpoint (8 tensors", "scheduler last_epoch 5",
                    "data position (epoch 0, batch 5)", "RNG streams (python, numpy, torch)"):
        assert checked in line, line
    assert " in 0.0" in line  # its cost, in seconds


def test_a_model_whose_load_state_dict_does_nothing_is_named(tmp_path: Path) -> None:
    _train(tmp_path, max_steps=5)
    with pytest.raises(ResumeNotApplied, match=r"the model does not hold the checkpoint's state after loading it "
                                               r"\(/model/fc\.\w+ \(other values\) differs\): its load_state_dict"):
        _train(tmp_path, IgnoresItsState())


def test_an_optimizer_re_created_after_the_run_was_built_is_named(tmp_path: Path) -> None:
    _train(tmp_path, max_steps=5)
    with pytest.raises(ResumeNotApplied, match=r"an optimizer that this Run does not checkpoint \(Adam\) stepped the "
                                               r"model's parameters: it was probably re-created after the Run"):
        _train(tmp_path, recreate_optimizer=True)


def test_a_scheduler_not_passed_warns_at_start_and_stops_the_resume(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    _train(tmp_path, max_steps=5, pass_scheduler=False)
    assert "a learning-rate scheduler steps 'optimizer' but was not passed to the Run" in capsys.readouterr().err
    with pytest.raises(ResumeNotApplied, match=r"steps 'optimizer' but was not passed to the Run: its position "
                                               r"\(last_epoch\) is not in the checkpoint"):
        _train(tmp_path, pass_scheduler=False)


class _DeafScheduler(torch.optim.lr_scheduler.StepLR):
    def load_state_dict(self, state_dict):  # noqa: ANN001, ANN201 - the planted bug
        return None


def test_a_scheduler_that_does_not_take_its_state_is_named(tmp_path: Path) -> None:
    _train(tmp_path, max_steps=5, scheduler_class=_DeafScheduler)
    with pytest.raises(ResumeNotApplied, match=r"the scheduler's last_epoch read back differs from the checkpoint "
                                               r"\(/ \(5 saved, 0 now\)\)"):
        _train(tmp_path, scheduler_class=_DeafScheduler)


def test_an_optimizer_that_does_not_take_its_state_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _train(tmp_path, max_steps=5)
    monkeypatch.setattr(torch.optim.Adam, "load_state_dict", lambda self, state: None)
    with pytest.raises(ResumeNotApplied, match=r"the optimizer does not hold the checkpoint's state .*/optimizer/st"):
        _train(tmp_path)


class _DeafScaler(torch.amp.GradScaler):
    def load_state_dict(self, state_dict):  # noqa: ANN001, ANN201 - the planted bug
        return None


def test_a_scaler_that_does_not_take_its_state_is_named(tmp_path: Path) -> None:
    _train(tmp_path, max_steps=5, scaler=_DeafScaler("cpu"))
    with pytest.raises(ResumeNotApplied, match=r"the AMP scaler read back differs from the checkpoint "
                                               r"\(/_growth_tracker \(5 saved, 0 now\)\)"):
        _train(tmp_path, scaler=_DeafScaler("cpu"))


def test_rng_streams_that_were_not_restored_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _train(tmp_path, max_steps=5)
    monkeypatch.setattr("resumable.engine.state.keeper.restore_rng", lambda state: None)
    with pytest.raises(ResumeNotApplied, match=r"the RNG streams read back differ from the checkpoint's \(/torch_cpu"):
        _train(tmp_path)
    assert len(list((tmp_path / "checkpoints").iterdir())) == 3  # nothing was changed on disk (steps 2, 4, 5)
