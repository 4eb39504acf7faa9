"""Which committed checkpoints to delete. Pure functions: no I/O, easy to test."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MODES = ("max", "min")


@dataclass(frozen=True)
class Best:
    """What "best" means: the metric ``monitor`` (a key of what ``evaluate()`` returns, recorded in each
    checkpoint's manifest) and whether higher (``mode="max"``) or lower (``"min"``) is better."""

    monitor: str = "test_acc"
    mode: str = "max"

    def __post_init__(self) -> None:
        if not isinstance(self.monitor, str) or not self.monitor:
            raise ValueError(f"monitor={self.monitor!r} must be the name of a metric evaluate() returns")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be 'max' (higher is better) or 'min' (lower is better)")

    @property
    def key(self) -> str:
        """``"val_loss:min"``: recorded with the best value, so a resume with another monitor starts afresh."""
        return f"{self.monitor}:{self.mode}"

    def value(self, metrics: Mapping[str, Any] | None) -> float | None:
        """The monitored metric in ``metrics`` as a finite float, or None (absent, NaN, not a number)."""
        value = metrics.get(self.monitor) if isinstance(metrics, Mapping) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value)

    def better(self, value: float, than: float | None) -> bool:
        """Whether ``value`` is strictly better than ``than`` (None: nothing yet, any value is better)."""
        return than is None or (value > than if self.mode == "max" else value < than)


BY_TEST_ACC = Best()  # the default: the highest test_acc


@dataclass(frozen=True)
class Candidate:
    step: int
    value: float | None = None  # the monitored metric recorded with the checkpoint (None: not evaluated there)


def best_step(candidates: Iterable[Candidate], best: Best = BY_TEST_ACC) -> int | None:
    """Step of the candidate with the best monitored value (the earliest on ties)."""
    scored = [c for c in candidates if c.value is not None]
    if not scored:
        return None
    sign = 1.0 if best.mode == "max" else -1.0
    return max(scored, key=lambda c: (sign * c.value, -c.step)).step


def rule_of(manifest: Mapping[str, Any] | None) -> Best:
    """The best-checkpoint rule a manifest records (``{"best": {"monitor": ..., "mode": ...}}``); test_acc, highest,
    for one written before runs could choose, or with a record that does not read."""
    record = manifest.get("best") if isinstance(manifest, Mapping) else None
    try:
        return Best(record["monitor"], record["mode"]) if isinstance(record, Mapping) else BY_TEST_ACC
    except (KeyError, ValueError):
        return BY_TEST_ACC


def best_entry(entries: Sequence[Mapping[str, Any]]) -> tuple[Best, Mapping[str, Any] | None]:
    """For a listing (``resumable inspect``: dicts with ``step``, ``valid``, ``metrics`` and ``best``, oldest first):
    the rule of the newest valid checkpoint and the valid entry that is best by it (None: none recorded it)."""
    valid = [e for e in entries if e.get("valid")]
    rule = rule_of(valid[-1]) if valid else BY_TEST_ACC
    chosen = best_step([Candidate(e["step"], rule.value(e.get("metrics"))) for e in valid], rule)
    return rule, next((e for e in valid if e["step"] == chosen), None)


def steps_to_prune(candidates: Sequence[Candidate], keep: int, keep_best: bool,
                   protect: Iterable[int] = (), best: Best = BY_TEST_ACC) -> list[int]:
    """Steps to delete so that the ``keep`` newest (by step number, never by name), the best by ``best`` when
    ``keep_best``, and every step in ``protect`` remain."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be at least 1")
    ordered = sorted(candidates, key=lambda c: c.step)
    kept = {c.step for c in ordered[-keep:]} | set(protect)
    if keep_best:
        chosen = best_step(ordered, best)
        if chosen is not None:
            kept.add(chosen)
    return [c.step for c in ordered if c.step not in kept]
