"""A map-style dataset ordered by the user's own sampler or batch sampler (engine/data/user_order.py): the three kinds
(state_dict, seeded per epoch, replayed), the refusals, a resume with another sampler, and SIGKILLed runs of a
weighted sampler and of a length-bucketed batch sampler (tests/sampler_train.py) that end bit-identical to an
uninterrupted run. Kill points are random but reproducible: the seed is printed, RESUMABLE_KILL_SEED replays it."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest
import sampler_train
import stream_train
import torch
from helpers import final_fingerprint, records, train_script
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, TensorDataset, WeightedRandomSampler

from resumable import Loader, Run
from resumable.engine.data.sampler import ResumableSampler
from resumable.engine.data.user_order import REPLAYED, SEEDED, STATEFUL, UserOrder
from resumable.errors import ResumeNotApplied
from resumable.faults import Faults

SCRIPT = Path(__file__).with_name("sampler_train.py")
N = sampler_train.SAMPLES


class IteratorState:
    """torchdata's RandomSampler's shape: the state lives on the iterator (its generator's state at the start)."""

    class _Iterator:
        def __init__(self, sampler: IteratorState) -> None:
            self.sampler, self.start = sampler, sampler.rng.get_state()
            self.inner = iter(torch.randperm(sampler.size, generator=sampler.rng).tolist())

        def __iter__(self) -> IteratorState._Iterator:
            return self

        def __next__(self) -> int:
            return next(self.inner)

        def state_dict(self) -> dict:
            return {"rng": self.start}

        def load_state_dict(self, state: dict) -> None:
            self.sampler.rng.set_state(state["rng"])
            self.inner = iter(torch.randperm(self.sampler.size, generator=self.sampler.rng).tolist())

    def __init__(self, size: int) -> None:
        self.size, self.rng = size, torch.Generator().manual_seed(3)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> IteratorState._Iterator:
        return IteratorState._Iterator(self)


def _order(user, batched: bool = False, drop_last: bool = False) -> UserOrder:  # noqa: ANN001 - any sampler
    return UserOrder(user, batched, N, 8, seed=5, drop_last=drop_last)


USERS = {  # name -> (a fresh sampler, batched, its kind)
    "weighted": (lambda: WeightedRandomSampler(torch.rand(N, generator=torch.Generator().manual_seed(1)), N,
                                               generator=torch.Generator()), False, SEEDED),
    "batch of random": (lambda: BatchSampler(RandomSampler(range(N), generator=torch.Generator()), 7, False), True,
                        SEEDED),
    "bucketed": (lambda: sampler_train.order("bucketed")["batch_sampler"], True, SEEDED),
    "stateful": (lambda: sampler_train.StatefulShuffle(N), False, STATEFUL),
    "iterator state": (lambda: IteratorState(N), False, STATEFUL),
    "replayed": (lambda: sampler_train.Drifting(N), False, REPLAYED),
    "global RNG": (lambda: RandomSampler(range(N)), False, REPLAYED),
}


@pytest.mark.parametrize("name", USERS)
def test_each_kind_makes_an_epoch_again_after_a_resume_without_touching_the_global_rng(name: str) -> None:
    make, batched, kind = USERS[name]
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = _order(make(), batched)
    assert first.kind == kind
    epochs = [[b.clone() for b in first.epoch_order(e)] for e in range(3)]
    assert torch.equal(torch.get_rng_state(), before), "a sampler's draws come from a fork of the global streams"
    if not batched:
        assert all(len(b) == 8 for b in epochs[0][:-1]) and sum(map(len, epochs[0])) == N
    assert any(not torch.equal(a, b) for a, b in zip(epochs[0], epochs[1], strict=True)), "epochs differ"
    list(first.walk(1, 3))  # the loop trains epoch 2 from batch 3: a checkpoint there
    saved = first.state_dict()
    torch.manual_seed(123)  # another global state in the resumed process
    again = _order(make(), batched)
    again.load_state_dict(saved)
    assert again.state_dict() == saved or kind == STATEFUL  # (tensors inside compare by identity)
    assert [b.tolist() for b in again.epoch_order(1)] == [b.tolist() for b in epochs[1]]
    assert [b.tolist() for b in again.epoch_order(2)] == [b.tolist() for b in epochs[2]]


def test_a_batch_sampler_keeps_its_batch_sizes_and_a_sampler_drops_the_short_last_batch() -> None:
    bucketed = _order(USERS["bucketed"][0](), batched=True)
    sizes = {len(b) for b in bucketed.epoch_order(0)}
    assert sizes == {12, 8, 6, 4} and bucketed.batches_per_epoch == len(bucketed.epoch_order(0)) == 21
    plain = UserOrder(SequentialSampler(range(N)), False, N, 7, seed=0, drop_last=True)
    assert plain.batches_per_epoch == N // 7 and all(len(b) == 7 for b in plain.epoch_order(0))


class NoLength:
    def __iter__(self):
        return iter(range(4))


class Lying(sampler_train.Drifting):
    def __len__(self) -> int:
        return N + 1


@pytest.mark.parametrize("build, error, message", [
    (lambda: Loader(sampler=range(4), batch_sampler=[[0]]), ValueError, "give one of them"),
    (lambda: _order(NoLength()), ValueError, "has no __len__: an epoch needs an end"),
    (lambda: _order([]), ValueError, "makes an empty epoch"),
    (lambda: UserOrder(range(N), False, N, 8, 0, False, world_size=2), ValueError, "under torchrun (2 processes) is "
                                                                                    "not supported"),
    (lambda: _order(Lying(N)).epoch_order(0), ValueError, f"gave {N} indices in epoch 1, but its len() is {N + 1}"),
    (lambda: _order([[0, 1], [N]], batched=True).epoch_order(0), ValueError, f"gave index {N} in epoch 1, outside"),
], ids=["both", "no len", "empty", "torchrun", "wrong len", "bad index"])
def test_a_sampler_that_cannot_be_resumed_exactly_is_refused_naming_the_fix(build, error, message: str) -> None:  # noqa: ANN001
    with pytest.raises(error) as caught:
        build()
    assert message in str(caught.value), str(caught.value)


def test_a_sampler_in_the_loader_options_or_with_a_stream_is_refused(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(8, 2), torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"pass your own as Loader\(sampler=...\)"):
        Run(tmp_path, model=model, optimizer=optimizer, data=data, batch_size=4,
            loader=Loader(options={"sampler": SequentialSampler(data)}))
    stream = stream_train.Plain()
    with pytest.raises(ValueError, match="order a map-style dataset"):
        Run(tmp_path, model=model, optimizer=optimizer, data=stream, batch_size=4,
            loader=Loader(sampler=SequentialSampler(data)))


def test_a_resume_with_another_sampler_or_without_one_is_refused() -> None:
    saved = _order(sampler_train.Drifting(N)).state_dict()
    with pytest.raises(ValueError, match=r"differs from the checkpoint's \(user_sampler: checkpoint 'replayed', "
                                         r"now 'seeded'; type: checkpoint 'Drifting', now 'WeightedRandomSampler'"):
        _order(USERS["weighted"][0]()).load_state_dict(saved)
    with pytest.raises(ValueError, match="written with your own 'Drifting' as the Loader's sampler"):
        ResumableSampler(N, 8, seed=5).load_state_dict(saved)
    with pytest.raises(ValueError, match="written with resumable's own sampler"):
        _order(sampler_train.Drifting(N)).load_state_dict(ResumableSampler(N, 8, seed=5).state_dict())


def _train(run_dir: Path, kind: str, workers: int = 0, faults: Faults | None = None, max_steps: int | None = None):
    args = [str(run_dir), kind, str(workers), *([str(max_steps)] if max_steps is not None else [])]
    return train_script(SCRIPT, sampler_train.main, args, faults)


def _same_as_uninterrupted(tmp_path: Path, kind: str, workers: int = 0) -> None:
    assert _train(tmp_path / "ref", kind, workers).returncode == 0
    assert final_fingerprint(tmp_path / "run") == final_fingerprint(tmp_path / "ref")
    assert records(tmp_path / "run") == records(tmp_path / "ref")


@pytest.mark.parametrize("kind", ["stateful", "replayed"])
def test_stopped_mid_epoch_and_resumed_in_process_is_identical(tmp_path: Path, kind: str) -> None:
    assert _train(tmp_path / "run", kind, max_steps=7).returncode == 0  # stopped after step 7 of 15 (checkpointed)
    assert _train(tmp_path / "run", kind, max_steps=20).returncode == 0  # into epoch 2, saved at step 20
    done = _train(tmp_path / "run", kind)
    assert done.returncode == 0, done.stderr[-3000:]
    if kind == "replayed":
        assert "replaying 20 batches of indices of your Drifting (Loader(sampler=...)) (" in done.stderr
        assert "ms) to reach epoch 1 batch 5; give it set_epoch/a generator/state_dict to resume in O(1)" in done.stderr
    else:
        assert "its state_dict at the start of each epoch is checkpointed" in done.stderr
        assert "replaying" not in done.stderr
    _same_as_uninterrupted(tmp_path, kind)


def test_a_replay_that_is_not_exact_stops_before_training(tmp_path: Path) -> None:
    assert _train(tmp_path / "run", "unseeded", max_steps=4).returncode == 0
    with pytest.raises(ResumeNotApplied, match=r"the data \(your Unseeded \(Loader\(sampler=...\)\), replayed\) "
                                               r"produced another batch at epoch 0, batch 4"):
        _train(tmp_path / "run", "unseeded")


def _kill_seed() -> int:
    seed = int(os.environ.get("RESUMABLE_KILL_SEED", random.SystemRandom().randrange(2**31)))
    print(f"kill seed {seed} (replay with RESUMABLE_KILL_SEED={seed})")
    return seed


@pytest.mark.parametrize(("kind", "workers", "steps"), [("weighted", 0, 30), ("bucketed", 2, 42)])
def test_sigkilled_inside_a_save_and_at_a_random_step_ends_bit_identical(tmp_path: Path, kind: str, workers: int,
                                                                         steps: int) -> None:
    rng = random.Random(_kill_seed())
    in_save = 3 * rng.randint(2, steps // 3 - 4)  # checkpoints every 3 steps (synchronous)
    at_step = rng.randint(in_save, steps - 2)  # the session after it resumes from the checkpoint before in_save
    for faults in (Faults(kill_in_save_at_step=in_save), Faults(kill_at_step=at_step)):
        done = _train(tmp_path / "run", kind, workers, faults)
        assert done.returncode == -signal.SIGKILL, f"the kill must land ({faults}):\n{done.stderr[-3000:]}"
    assert f"resuming from step {in_save - 3}" in done.stderr
    finished = _train(tmp_path / "run", kind, workers)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "the first batch is compared with the checkpoint's record of its sample indices" in finished.stderr
    _same_as_uninterrupted(tmp_path, kind, workers)
