from __future__ import annotations

import pytest
import torch

from resumable.engine.sampler import ResumableSampler, epoch_seed


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
