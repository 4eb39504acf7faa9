"""More data sources than the Run's ``data`` (``run.loader(name, dataset, ...)``, engine/data/more_sources.py): each has
its own order and goes on epoch after epoch; its position is checkpointed, so the GAN example with two sources, killed
with SIGKILL at exact steps, inside a save and at random moments under chaos, ends as the uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import env, final_fingerprint, records, run
from torch.utils.data import TensorDataset

from resumable import Loader, Reporting, Run
from resumable.distributed import Distributed
from resumable.engine.data.more_sources import MoreBatches
from resumable.faults import Faults
from resumable.reporting.metrics import without_timing

GAN = Path(__file__).resolve().parent.parent / "scripts" / "gan_example.py"
OPTIONS = ["--epochs", "10", "--checkpoint-steps", "3", "--log-every", "1"]


def _source(name: str = "codes", size: int = 10, workers: int = 0) -> MoreBatches:
    data = TensorDataset(torch.arange(size))
    return MoreBatches(name, data, 4, 0, True, False, Loader(num_workers=workers).loader_options(), Distributed())


def _draw(source: MoreBatches, count: int) -> list[list[int]]:
    return [next(source)[0].tolist() for _ in range(count)]


def test_a_source_goes_on_epoch_after_epoch_in_its_own_order() -> None:
    batches = _draw(_source(), 6)  # 10 samples in 4s: 3 batches an epoch, the last one short
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    assert sorted(sum(batches[:3], [])) == list(range(10)) == sorted(sum(batches[3:], []))
    assert batches[:3] != batches[3:]  # each epoch its own order
    assert _draw(_source("other"), 3) != batches[:3]  # each source its own order too


@pytest.mark.parametrize("workers", [0, 2])
def test_a_source_loaded_from_its_state_gives_the_batches_the_first_would_have_given(workers: int) -> None:
    first = _source(workers=workers)
    _draw(first, 4)  # into its second epoch
    state = first.state_dict()
    assert (state["epoch"], state["batch"]) == (1, 1)
    expected = _draw(first, 5)
    again = _source(workers=workers)
    again.load_state_dict(state)
    assert _draw(again, 5) == expected
    first.close()
    again.close()


def test_a_source_whose_data_changed_is_refused_on_resume() -> None:
    state = _source(size=10).state_dict()
    with pytest.raises(ValueError, match=r"run.loader\('codes'\): the data order .*num_samples: checkpoint 10, now 12"):
        _source(size=12).load_state_dict(state)


def test_a_source_is_declared_once_before_the_loop_with_map_style_data(tmp_path: Path) -> None:
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(8, 1))
    training = Run(tmp_path, model=model, optimizer=optimizer, data=data, batch_size=4,
                   reporting=Reporting(progress=False))
    training.loader("codes", data, batch_size=2)
    with pytest.raises(ValueError, match="declared twice"):
        training.loader("codes", data, batch_size=2)
    with pytest.raises(ValueError, match="for the Run's data= only"):
        training.loader("weighted", data, batch_size=2, loader=Loader(sampler=range(8)))
    with pytest.raises(TypeError, match="map-style Dataset"):
        training.loader("stream", iter([1, 2]), batch_size=2)
    for _ in training:
        break
    training.close()
    with pytest.raises(RuntimeError, match="must come before the loop"):
        training.loader("late", data, batch_size=2)


def _gan(run_dir: Path, faults: Faults | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GAN), "--run-dir", str(run_dir), *OPTIONS], capture_output=True,
                          text=True, timeout=300, env=env(**(faults.to_env() if faults else {})),
                          stdin=subprocess.DEVNULL)


def test_the_gan_with_two_sources_killed_at_steps_and_inside_a_save_ends_as_the_uninterrupted_run(
        tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert _gan(reference).returncode == 0
    run_dir = tmp_path / "run"
    for faults in (Faults(kill_at_step=7), Faults(kill_in_save_at_step=15), Faults(kill_at_step=42)):
        killed = _gan(run_dir, faults)  # 7: mid-epoch, the codes in their second epoch; 15: inside a save
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    done = _gan(run_dir)
    assert done.returncode == 0 and "resuming from step" in done.stderr, done.stderr[-2000:]
    assert final_fingerprint(run_dir) == final_fingerprint(reference)
    assert without_timing(records(run_dir)) == without_timing(records(reference))


def test_chaos_kills_the_gan_at_random_moments_and_it_ends_identical(tmp_path: Path) -> None:
    result = run(["chaos", "--target", f"{GAN}:main", "--warm", "--kills", "3", "--seed", "7", "--every", "0.2s",
                  "--workdir", str(tmp_path), "--json", "--", "--run-dir", "{run_dir}", *OPTIONS],
                 name="resumable", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["verdict"] == "IDENTICAL", report["difference"]
    assert report["kills"] and report["kills"][0]["mid_save"]
