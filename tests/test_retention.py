from __future__ import annotations

import pytest

from resumable.checkpoint.retention import Candidate, best_step, steps_to_prune


def cands(*steps: int) -> list[Candidate]:
    return [Candidate(s) for s in steps]


def test_sorts_by_number_across_powers_of_ten() -> None:
    steps = [9, 10, 11, 99, 100, 101, 999, 1000, 1001]
    assert steps_to_prune(cands(*reversed(steps)), keep=3, keep_best=False) == [9, 10, 11, 99, 100, 101]
    assert steps_to_prune(cands(9, 10, 11), keep=2, keep_best=False) == [9]
    assert steps_to_prune(cands(99, 100), keep=1, keep_best=False) == [99]


def test_keeps_best_by_test_accuracy() -> None:
    c = [Candidate(10, 0.9), Candidate(20, 0.95), Candidate(30, None), Candidate(40, 0.93), Candidate(50)]
    assert best_step(c) == 20
    assert steps_to_prune(c, keep=2, keep_best=True) == [10, 30]
    assert steps_to_prune(c, keep=2, keep_best=False) == [10, 20, 30]


def test_protect_and_small_sets() -> None:
    assert steps_to_prune(cands(1, 2, 3), keep=1, keep_best=False, protect=[1]) == [2]
    assert steps_to_prune(cands(5), keep=3, keep_best=True) == []
    with pytest.raises(ValueError):
        steps_to_prune(cands(1), keep=0, keep_best=False)
