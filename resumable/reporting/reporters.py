"""Observers of a training session: the loop decides and emits events, reporters record them.

Each reporter turns the same events into one kind of output: ``metrics.jsonl``, TensorBoard events, the
progress bar, the console summary, the session history. A reporter that fails (a full disk, a closed
stream) is warned about once and never stops training or a save.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from .. import log
from .history import SessionLog
from .metrics import MetricsLog
from .tensorboard import TensorBoardLog


class Reporter:
    """No-op defaults; a reporter overrides the events it records."""

    def session_start(self, step: int, total_steps: int | None, resumed_from: int | None) -> None: ...

    def epoch_begin(self, epoch: int, epochs: int) -> None: ...

    def step(self, step: int, record: dict[str, Any] | None, postfix: dict[str, str] | None) -> None: ...

    def summary(self, record: dict[str, Any], line: str) -> None:
        """An epoch ended or an evaluation ran within one: its record (step, metrics...) and one line saying it."""

    def before_commit(self) -> None:
        """On the checkpoint writer's thread, right before a checkpoint commits: make records durable."""

    def session_end(self, step: int, ended: str) -> None: ...


class Reporters(Reporter):
    """Fans every event out to ``reporters``; a failing one is reported once and skipped from then on."""

    def __init__(self, reporters: Sequence[Reporter]) -> None:
        self.reporters = list(reporters)
        self._failed: set[int] = set()

    def _each(self, event: str, *args: Any) -> None:
        for index, reporter in enumerate(self.reporters):
            if index in self._failed:
                continue
            try:
                getattr(reporter, event)(*args)
            except (OSError, ValueError) as e:  # a full disk, EIO, a closed file: lose the record, not the run
                self._failed.add(index)
                log.warning(f"{type(reporter).__name__} stopped recording ({e}); training and checkpoints go on")

    def session_start(self, *args: Any) -> None:
        self._each("session_start", *args)

    def epoch_begin(self, *args: Any) -> None:
        self._each("epoch_begin", *args)

    def step(self, *args: Any) -> None:
        self._each("step", *args)

    def summary(self, *args: Any) -> None:
        self._each("summary", *args)

    def before_commit(self) -> None:
        self._each("before_commit")

    def session_end(self, *args: Any) -> None:
        self._each("session_end", *args)


class MetricsReporter(Reporter):
    """Training and evaluation records into ``metrics.jsonl`` (fsynced before each checkpoint commits)."""

    def __init__(self, metrics: MetricsLog) -> None:
        self.metrics = metrics

    def step(self, step: int, record: dict[str, Any] | None, postfix: dict[str, str] | None) -> None:
        if record is not None:
            self.metrics.log(record)

    def summary(self, record: dict[str, Any], line: str) -> None:
        self.metrics.log(record)

    def before_commit(self) -> None:
        self.metrics.sync()

    def session_end(self, step: int, ended: str) -> None:
        self.metrics.sync()
        self.metrics.close()


class TensorBoardReporter(Reporter):
    """The same records as TensorBoard scalars (see reporting/tensorboard.py for purge on resume)."""

    def __init__(self, board: TensorBoardLog) -> None:
        self.board = board

    def session_start(self, step: int, total_steps: int | None, resumed_from: int | None) -> None:
        self.board.open(resumed_from)

    def step(self, step: int, record: dict[str, Any] | None, postfix: dict[str, str] | None) -> None:
        if record is not None:
            self.board.record(record)

    def summary(self, record: dict[str, Any], line: str) -> None:
        self.board.record(record)

    def before_commit(self) -> None:
        self.board.flush()

    def session_end(self, step: int, ended: str) -> None:
        self.board.close()


class ProgressReporter(Reporter):
    """One tqdm bar over the whole run (all sessions), with the loss and throughput."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def session_start(self, step: int, total_steps: int | None, resumed_from: int | None) -> None:
        # total None: a stream whose length is not known yet (the bar counts steps without a total)
        initial = step if total_steps is None else min(step, total_steps)
        self.bar = tqdm(total=total_steps, initial=initial, unit="step", file=sys.stderr,
                        dynamic_ncols=True)

    def epoch_begin(self, epoch: int, epochs: int) -> None:
        if self.bar is not None:
            self.bar.set_description(f"epoch {epoch + 1}/{epochs}")

    def step(self, step: int, record: dict[str, Any] | None, postfix: dict[str, str] | None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:
                self.bar.set_postfix(**postfix)

    def session_end(self, step: int, ended: str) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class ConsoleReporter(Reporter):
    """The one-line summary of each epoch and evaluation."""

    def summary(self, record: dict[str, Any], line: str) -> None:
        log.info(line)


class HistoryReporter(Reporter):
    """The start and end of each session in ``sessions.jsonl`` (how it ended: the crash-loop evidence)."""

    def __init__(self, sessions: SessionLog, note: str | None = None, extra: dict | None = None) -> None:
        self.sessions = sessions
        self.note = note
        self.extra = extra  # more fields of the start record (the device, an AMP switch)

    def session_start(self, step: int, total_steps: int | None, resumed_from: int | None) -> None:
        self.sessions.start(step, resumed_from, self.note, self.extra)

    def session_end(self, step: int, ended: str) -> None:
        self.sessions.end(step, ended)
