"""Knowing when to stop: signal flags and the session time budget (its Colab default: resumable/platforms.py).

Signal handlers only set a flag; the loop commits a checkpoint at the next step boundary and the process
exits with :data:`EXIT_RESUME` ("stopped early, state committed, run again to continue"). A second
SIGINT raises KeyboardInterrupt at once, and so does any second stop signal while the loop waits for a checkpoint
save (:class:`~resumable.errors.StopNow` for SIGTERM, SIGHUP, SIGUSR1): a save stuck on a dead mount must not hold
the process; the last committed checkpoint stays valid.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from ... import log, platforms
from ...config import RunOptions, format_duration
from ...errors import StopNow

# SIGHUP: the terminal or SSH session closed; the run saves and stops as for SIGTERM.
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP")
_EARLY: list[str] = []  # stop signals that arrived before training started (see install_startup_handlers)


def _remember(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if name == "SIGINT" and "SIGINT" in _EARLY:
        raise KeyboardInterrupt  # a second Ctrl-C during start-up: stop now
    _EARLY.append(name)


def install_startup_handlers() -> None:
    """First thing in an entry point (before ``import torch``): a stop signal during start-up is remembered, and
    training, once it starts, commits a checkpoint at its first step boundary and exits 75 (a Colab VM that is
    being stopped sends SIGTERM whenever it likes, imports included)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in STOP_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), _remember)


class StopFlag:
    """Installs handlers for SIGTERM, SIGINT, SIGUSR1 and SIGHUP while active; restores the old ones on exit.

    ``saving`` (set by the loop while it waits for a save): a second stop signal then stops at once. ``armed``: the
    loop is running, so an exception handed over by :meth:`interrupt` (a hang found by the watchdog) or a forced
    stop is raised; once the loop ends (its clean-up), signals only set :attr:`requested` and :attr:`forced`, which
    the clean-up's waits poll. :meth:`suspend` gives the signals back while control is outside the loop (a notebook
    cell ended with the loop suspended), :meth:`resume` takes them again.

    >>> with StopFlag() as flag:
    ...     flag.requested is None
    True
    """

    def __init__(self, signals: tuple[str, ...] = STOP_SIGNALS) -> None:
        self.signals = [getattr(signal, name) for name in signals if hasattr(signal, name)]
        self.requested: str | None = None  # name of the first signal received
        self.requested_at: float | None = None  # when it arrived (time.monotonic())
        self.forced = False  # a second Ctrl-C: stop at once
        self.saving = False  # the loop waits for a checkpoint save
        self.armed = True  # the loop runs: an exception handed over by interrupt() is raised
        self._pending: BaseException | None = None
        self._thread: int | None = None  # the training thread (the one that entered)
        self._previous: dict[int, Any] = {}
        self._suspended = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        pending, self._pending = self._pending, None
        if pending is not None:  # the signal interrupt() sent to carry it
            if self.armed:
                raise pending
            return
        if self.requested is not None and (self.saving or self.requested == name == "SIGINT"):
            self.forced = True  # the clean-up that follows must not wait (e.g. for Drive uploads)
            if not self.armed:
                return  # the loop is ending: its clean-up sees ``forced`` and stops waiting
            if name == "SIGINT":
                raise KeyboardInterrupt  # second Ctrl-C: stop now
            raise StopNow(name)
        if self.requested is None:
            self.requested, self.requested_at = name, time.monotonic()

    def interrupt(self, error: BaseException, wait_s: float = 10.0) -> bool:
        """From another thread: raise ``error`` in the training thread, even inside a blocking system call (the main
        thread gets a signal, whose handler raises it). Returns whether it was taken within ``wait_s``; a thread
        blocked in C code that does not return takes it when (if ever) it returns."""
        thread = self._thread
        if thread is None:
            return False
        if thread == threading.main_thread().ident and self._previous:
            self._pending = error
            signal.pthread_kill(thread, signal.SIGINT)
            deadline = time.monotonic() + wait_s
            while self._pending is not None and time.monotonic() < deadline:
                time.sleep(0.02)
            return self._pending is None
        # The loop runs in another thread (no signal reaches it): an exception raised at its next bytecode.
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(type(error)))
        return True

    def suspend(self) -> None:
        """Give the signals back to their previous handlers (control is outside the loop) until :meth:`resume`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._suspended = bool(self._previous)

    def resume(self) -> None:
        if self._suspended:
            self._suspended = False
            self._install()

    def _install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                previous = signal.signal(signum, self._handle)
                self._previous.setdefault(signum, previous)

    def __enter__(self) -> StopFlag:
        self._thread = threading.get_ident()
        self._install()
        if _EARLY and self.requested is None:  # a signal that arrived during start-up
            self.requested, self.requested_at = _EARLY[0], time.monotonic()
            _EARLY.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        self.armed = False
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
        self._previous.clear()


class Budget:
    """A wall-clock deadline for this session, checked before each step.

    ``fits(step_s, save_s)`` is False once the next step plus a final save (with a margin) would no
    longer finish before the deadline. ``durable_s(checkpoints)`` (set for a run dir on Drive: the mirror's
    estimate) adds the time the final checkpoint then takes to become durable remotely, so that it is there before
    the deadline, not only on the local disk; with ``saves=2`` (a checkpoint is committed before the next check,
    then the final one) it reserves both uploads, so that a periodic save that would push the final one past the
    deadline becomes the final save instead.
    """

    def __init__(self, limit_s: float | None, start: float | None = None, margin: float = 1.5,
                 floor_s: float = 1.0, durable_s: Callable[[int], float] | None = None) -> None:
        self.limit_s = limit_s
        self.start = time.monotonic() if start is None else start
        self.margin = margin
        self.floor_s = floor_s
        self.durable_s = durable_s
        self.reserved: tuple[float, float] = (0.0, 0.0)  # (save, upload) seconds reserved at the last check

    @property
    def deadline(self) -> float | None:
        return None if self.limit_s is None else self.start + self.limit_s

    def remaining(self, now: float | None = None) -> float | None:
        if self.deadline is None:
            return None
        return self.deadline - (time.monotonic() if now is None else now)

    def fits(self, step_s: float, save_s: float, now: float | None = None, saves: int = 1) -> bool:
        """``saves``: checkpoints committed from now until the final one, counting it (2 when one is due before
        the next check)."""
        remaining = self.remaining(now)
        if remaining is None:
            return True
        upload_s = self.durable_s(saves) if self.durable_s is not None else 0.0
        self.reserved = (save_s, upload_s)
        return remaining > (step_s + save_s + upload_s) * self.margin + self.floor_s


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0 elsewhere), so a --time-limit also counts
    interpreter start-up and imports."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22 of stat, counted after the command name
        uptime = platforms.vm_uptime_s()
        if uptime is None:
            return 0.0
        return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


def session_budget(options: RunOptions, durable_s: Callable[[int], float] | None = None) -> Budget:
    """This session's budget: ``time_limit`` counted from the process's start, else in Colab the VM's lifetime (on
    Kaggle the session's limit) less a margin, else none; and at the latest ``$RESUMABLE_DEADLINE``
    (platforms.DEADLINE_ENV: what a supervisor, ``resumable run --time-limit``, leaves of its session).
    ``durable_s``: a Drive run dir's upload estimate (see Budget)."""
    budget = _own_budget(options, durable_s)
    left = platforms.deadline_left_s()
    if left is None:
        return budget
    mine = budget.remaining()
    if mine is not None and mine <= left:
        return budget
    log.info(f"stopping cleanly within {format_duration(left)} ({platforms.DEADLINE_ENV}: what is left of the "
             f"supervised session's --time-limit)")
    return Budget(left, durable_s=durable_s)


def _own_budget(options: RunOptions, durable_s: Callable[[int], float] | None) -> Budget:
    start = time.monotonic() - process_age_s()
    if options.time_limit_s is not None:
        return Budget(options.time_limit_s, start=start, durable_s=durable_s)
    session = platforms.hosted()
    if session is None:
        return Budget(None, durable_s=durable_s)
    lifetime = f"{format_duration(session.lifetime_s)} lifetime ({session.source}, counted from {session.counted_from})"
    change = f"set {session.lifetime_env} or --time-limit"
    if session.left_s <= 0:  # no floor: a step now would eat the margin kept for the last save before the end
        log.warning(f"{session.name}: less than {format_duration(platforms.COLAB_SAFETY_S)} is left of its {lifetime}: "
                    f"saving a checkpoint and stopping now, before any step. Continue in a fresh session, or {change} "
                    f"if this one lives longer")
    else:
        log.info(f"{session.name} detected: stopping cleanly after {format_duration(session.left_s)} (before its "
                 f"{lifetime}); {change} to change it")
    return Budget(session.left_s, durable_s=durable_s)


def integration_limit_s(given: float | None) -> float | None:
    """The budget of an integration's session (the Trainer, Lightning and Accelerate callbacks): ``given`` (their
    ``time_limit``), else what is left of a Colab VM's or Kaggle session's life less the margin; at most what a
    supervisor's deadline leaves (``resumable run --time-limit``: $RESUMABLE_DEADLINE). None when none applies."""
    session = platforms.hosted()
    own = given if given is not None else session.left_s if session is not None else None
    limits = [v for v in (own, platforms.deadline_left_s()) if v is not None]
    return min(limits) if limits else None
