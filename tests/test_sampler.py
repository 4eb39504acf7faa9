from __future__ import annotations

import itertools

import pytest
import torch

from resumable.engine.data.sampler import ResumableSampler, epoch_seed


@pytest.mark.parametrize("n, bs", [(10, 4), (8000, 128), (7, 7), (5, 9)])
def test_each_epoch_is_a_permutation_covered_by_its_batches(n: int, bs: int) -> None:
    s = ResumableSampler(n, bs, seed=3)
    for epoch in range(3):
        order = s.epoch_order(epoch)
        batches = [s.batch(order, k) for k in range(s.batches_per_epoch)]
        assert torch.equal(torch.cat(batches).sort().values, torch.arange(n))
        assert all(len(b) == bs for b in batches[:-1])


def test_order_is_a_pure_function_of_seed_and_epoch() -> None:
    torch.manual_seed(0)
    a = ResumableSampler(1000, 10, seed=5).epoch_order(4)
    torch.manual_seed(123)  # the global RNG must not matter
    b = ResumableSampler(1000, 10, seed=5).epoch_order(4)
    assert torch.equal(a, b)
    assert not torch.equal(a, ResumableSampler(1000, 10, seed=5).epoch_order(5))
    assert not torch.equal(a, ResumableSampler(1000, 10, seed=6).epoch_order(4))


def test_sampler_does_not_consume_global_rng() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    ResumableSampler(100, 10, seed=1).epoch_order(0)
    assert torch.equal(before, torch.get_rng_state())


def test_epoch_seeds_are_distinct() -> None:
    seeds = {epoch_seed(s, e) for s in range(20) for e in range(50)}
    assert len(seeds) == 1000


def test_batch_out_of_range_and_state_mismatch() -> None:
    s = ResumableSampler(10, 4, seed=0)
    with pytest.raises(IndexError):
        s.batch(s.epoch_order(0), 3)
    with pytest.raises(ValueError, match="batch_size"):
        s.load_state_dict({**s.state_dict(), "batch_size": 5})
    s.load_state_dict(s.state_dict())


@pytest.mark.parametrize(("size", "batch", "world"), [(97, 8, 2), (130, 64, 2), (7, 2, 2), (1000, 64, 3), (9, 4, 2),
                                                      (21, 5, 4), (3, 1, 2), (5, 4, 2)])
def test_every_ddp_rank_gets_at_least_two_samples_in_every_step(size: int, batch: int, world: int) -> None:
    # An empty batch gives a NaN loss and a 1-sample batch a BatchNorm error ("Expected more than 1 value per
    # channel") on that rank: a short last step that would do so is not taken.
    ranks = [ResumableSampler(size, batch, seed=1, rank=r, world_size=world) for r in range(world)]
    floor = min(2, batch)
    for epoch in (0, 1):
        order = ranks[0].epoch_order(epoch)
        taken = []
        for k in range(ranks[0].batches_per_epoch):
            parts = [s.batch(order, k) for s in ranks]
            assert min(len(p) for p in parts) >= floor, (k, [len(p) for p in parts])
            taken += [int(i) for p in parts for i in p]
        assert len(taken) == len(set(taken)) and taken == order[:len(taken)].tolist()
        assert size - len(taken) == ranks[0].dropped_per_epoch < min(2, batch) * world


def test_a_dropped_short_step_is_announced_once_and_a_single_process_keeps_every_sample(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from resumable import log

    warnings: list[str] = []
    monkeypatch.setattr(log, "warning", lambda message, **_: warnings.append(message))
    ddp = ResumableSampler(97, 8, seed=1, rank=0, world_size=2)
    assert (ddp.batches_per_epoch, ddp.dropped_per_epoch) == (6, 1)
    for epoch in range(3):
        ddp.epoch_order(epoch)
    single = ResumableSampler(97, 8, seed=1)
    assert (single.batches_per_epoch, single.dropped_per_epoch) == (13, 0)
    assert len(single.batch(single.epoch_order(0), 12)) == 1  # a single process keeps its 1-sample last batch
    assert len(warnings) == 1 and "1 trailing sample(s) of each epoch" in warnings[0], warnings


def test_a_dataset_too_small_for_the_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="too few for 2 processes"):
        ResumableSampler(3, 8, seed=0, world_size=2)


@pytest.mark.parametrize(("size", "batch", "before", "after", "trained"),
                         [(100, 4, 1, 2, 5), (100, 4, 2, 1, 3), (97, 5, 2, 3, 4), (97, 5, 3, 2, 2), (64, 8, 2, 1, 3),
                          (50, 3, 1, 4, 7)])
def test_a_resume_at_another_world_size_goes_on_at_the_exact_sample(size: int, batch: int, before: int, after: int,
                                                                     trained: int) -> None:
    """Issue #33: ``trained`` steps at ``before`` ranks, then the rest of the epoch at ``after`` ranks: no sample of the
    epoch is trained twice, and none is skipped but the trailing ones a short last step cannot split (announced),
    also when the samples done are not a multiple of the new global batch. The next epoch starts at its first sample."""
    from resumable.engine.state.remap import remap_position
    from resumable.engine.state.train_state import TrainState

    seen: list[int] = []
    old = [ResumableSampler(size, batch, seed=4, rank=r, world_size=before) for r in range(before)]
    for sampler in old:
        seen += [i for _, indices, _, _ in itertools.islice(sampler.walk(0, 0), trained) for i in indices.tolist()]
    new = [ResumableSampler(size, batch, seed=4, rank=r, world_size=after) for r in range(after)]
    for rank, sampler in enumerate(new):
        state = TrainState(step=trained, epoch=0, batch_in_epoch=trained)
        sampler.load_state_dict(old[0].state_dict())
        remap_position(state, sampler, before, after, seed=4, rank=rank)
        assert state.batch_in_epoch == 0 and sampler.start_of(0) == trained * batch * before
        seen += [i for _, indices, _, _ in sampler.walk(0, 0) for i in indices.tolist()]
        assert sampler.start_of(1) == 0 and sampler.batches_in(1) == sampler.batches_per_epoch
    order = ResumableSampler(size, batch, seed=4).epoch_order(0).tolist()
    assert len(seen) == len(set(seen)), "a sample was trained twice"
    missing = [i for i in order if i not in set(seen)]
    assert missing == order[len(order) - len(missing):] and len(missing) < 2 * after, missing
    assert "offset" in new[0].state_dict(), "the next checkpoint records where the remapped epoch started"
