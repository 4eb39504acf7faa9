"""Which committed checkpoints to delete. Pure functions: no I/O, easy to test."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    step: int
    test_acc: float | None = None


def best_step(candidates: Iterable[Candidate]) -> int | None:
    """Step of the candidate with the highest test accuracy (the earliest on ties)."""
    scored = [c for c in candidates if c.test_acc is not None]
    if not scored:
        return None
    return max(scored, key=lambda c: (c.test_acc, -c.step)).step


def steps_to_prune(candidates: Sequence[Candidate], keep: int, keep_best: bool,
                   protect: Iterable[int] = ()) -> list[int]:
    """Steps to delete so that the ``keep`` newest (by step number, never by name), the best by test
    accuracy when ``keep_best``, and every step in ``protect`` remain."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be at least 1")
    ordered = sorted(candidates, key=lambda c: c.step)
    kept = {c.step for c in ordered[-keep:]} | set(protect)
    if keep_best:
        best = best_step(ordered)
        if best is not None:
            kept.add(best)
    return [c.step for c in ordered if c.step not in kept]
