"""When to checkpoint: every N steps, every T seconds of wall clock, or an interval chosen from the
measured save cost and the expected time between failures (Young's formula)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from ... import log
from ...config import RunOptions, format_duration, parse_duration

AUTO_MIN_S = 30.0
AUTO_MAX_S = 30 * 60.0


def young_interval(save_cost_s: float, mtbf_s: float, low: float = AUTO_MIN_S, high: float = AUTO_MAX_S) -> float:
    """sqrt(2 · C · M), bounded to [low, high]: the interval that minimises expected lost time plus
    checkpoint overhead for a save cost C and mean time between failures M."""
    return min(max(math.sqrt(2.0 * max(save_cost_s, 0.0) * mtbf_s), low), high)


class SaveTriggers:
    """Decides at each step boundary whether a checkpoint is due.

    >>> t = SaveTriggers(every_steps=10, every_s=None)
    >>> t.due(step=10, now=0.0), t.due(step=11, now=0.0)
    ('steps', None)
    """

    def __init__(self, every_steps: int | None, every_s: float | None, auto_mtbf_s: float | None = None,
                 now: float | None = None) -> None:
        self.every_steps = every_steps
        self.auto_mtbf_s = auto_mtbf_s
        self.every_s = AUTO_MIN_S if auto_mtbf_s is not None else every_s
        self.last_save = time.monotonic() if now is None else now

    def due(self, step: int, now: float | None = None) -> str | None:
        if self.every_steps and step % self.every_steps == 0:
            return "steps"
        if self.every_s is not None:
            now = time.monotonic() if now is None else now
            if now - self.last_save >= self.every_s:
                return "time"
        return None

    def saved(self, cost_s: float, now: float | None = None) -> float | None:
        """Record a save; with auto, returns the new interval chosen from its cost ``cost_s``."""
        self.last_save = time.monotonic() if now is None else now
        if self.auto_mtbf_s is None:
            return None
        self.every_s = young_interval(cost_s, self.auto_mtbf_s)
        return self.every_s


def save_triggers(options: RunOptions) -> SaveTriggers:
    """The triggers ``options`` ask for (``checkpoint_every="auto"``: Young's interval from ``mtbf``)."""
    if options.checkpoint_every == "auto":
        return SaveTriggers(options.checkpoint_steps, None, auto_mtbf_s=parse_duration(options.mtbf))
    return SaveTriggers(options.checkpoint_steps, options.checkpoint_every_s)


def interval_notice(options: RunOptions) -> Callable[[float, float], None] | None:
    """With ``checkpoint_every="auto"``: what says the interval chosen, each time it changes noticeably."""
    if options.checkpoint_every != "auto":
        return None
    announced: list[float] = []

    def announce(interval: float, cost: float) -> None:
        if announced and abs(interval - announced[-1]) <= 0.1 * announced[-1]:
            return
        announced.append(interval)
        log.info(f"--checkpoint-every auto: a save blocks training {cost * 1000:.1f} ms, MTBF {options.mtbf} "
                 f"→ checkpoint every {format_duration(interval)}")

    return announce
