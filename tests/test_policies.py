"""The Run's public shape: a small constructor with frozen, validated policy records (issue 32)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import resumable
from resumable.policies import Checkpointing, Loader, Location, Reporting, Session, from_options, to_options


def test_the_constructor_is_small_and_takes_no_loose_options() -> None:
    parameters = inspect.signature(resumable.Run.__init__).parameters
    assert len(parameters) - 1 <= 20  # self aside
    assert not any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    assert not {"computation", "settings", "prepared", "faults", "amp_switch"} & set(parameters), "no tool hooks"
    assert {"Run", "Checkpointing", "Session", "Reporting", "Loader", "Location"} <= set(resumable.__all__)
    assert not {"Faults", "CheckpointManager", "StateKeeper", "RunOptions", "TrainConfig"} & set(resumable.__all__)


@pytest.mark.parametrize("build, message", [
    (lambda: Checkpointing(every="soon"), "Checkpointing(every='soon'): duration 'soon' is not like"),
    (lambda: Checkpointing(keep=0), "Checkpointing(keep=0): must be at least 1"),
    (lambda: Checkpointing(on_error="ignore"), "Checkpointing(on_error='ignore'): must be warn or stop"),
    (lambda: Session(resume="maybe"), "Session(resume='maybe') must be auto, must or never"),
    (lambda: Session(time_limit="11 hours"), "Session(time_limit='11 hours'):"),
    (lambda: Reporting(log_every=0), "Reporting(log_every=0): must be at least 1"),
    (lambda: Loader(num_workers=-1), "Loader(num_workers=-1) must be 0 or more"),
    (lambda: Location("runs/x", cache_dir=""), "Location(cache_dir=''):"),
], ids=["every", "keep", "on_error", "resume", "time_limit", "log_every", "num_workers", "cache_dir"])
def test_a_policy_refuses_a_bad_value_when_built_naming_its_own_field(build, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError) as caught:
        build()
    assert str(caught.value).startswith(message), str(caught.value)


def test_policies_are_frozen_and_round_trip_through_the_engines_options() -> None:
    checkpointing = Checkpointing(every="10m", steps=5, keep=2, synchronous=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        checkpointing.keep = 5  # type: ignore[misc]
    options = to_options(3, Location("runs/x", cache_dir="cache"), checkpointing, Session(max_steps=7),
                         Reporting(progress=False))
    assert (options.epochs, options.checkpoint_every, options.checkpoint_steps, options.keep) == (3, "10m", 5, 2)
    assert (options.sync_checkpoints, options.max_steps, options.progress, options.cache_dir) == (True, 7, False,
                                                                                                  "cache")
    back = from_options(options, "runs/x", resume="never")
    assert back["checkpointing"] == checkpointing and back["session"] == Session(resume="never", max_steps=7)
    assert back["run_dir"] == Location("runs/x", cache_dir="cache") and back["epochs"] == 3


def test_the_records_reach_the_run(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    run = resumable.Run(Location(tmp_path / "run"), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        data=data, batch_size=8, epochs=3, checkpointing=Checkpointing(steps=2, keep=1),
                        session=Session(max_steps=5), reporting=Reporting(progress=False, quiet=True))
    for _epoch, _step, (x, y) in run:
        run.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        run.optimizer.step()
    assert run.state.step == 5 and run.finished and run.exit_code == 0  # Session(max_steps=5) ends the run there
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert steps == ["step-000000005"], "Checkpointing(keep=1) keeps the newest only"
