"""Runs checkpoint persistence inline or on one background thread, and accounts for its cost.

At most one save is in flight: ``submit`` waits for the previous one first. An exception raised by a
background save is kept and raised on the training thread by the next ``check``/``wait``/``submit``,
as :class:`SaveFailed`; a failed save never writes a manifest, so it never counts as a checkpoint.

Waits are slices of 0.1 s, so a signal handler can raise in the waiting thread (a second Ctrl-C) and the caller can
watch the wait (``on_wait``). A save the caller gives up on (stuck on a dead mount) is :meth:`abandon`-ed: it must
not commit after the session ended (its job checks the ``abandoned`` event it was submitted with before its
manifest); its thread, if stuck in a system call, cannot be stopped and ends with the process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import SaveFailed

__all__ = ["CheckpointWriter", "SaveFailed", "SaveStats"]


@dataclass
class SaveStats:
    saves: int = 0
    blocked_s: float = 0.0  # training-thread time spent in save()
    background_s: float = 0.0  # time spent serialising, hashing, writing and committing
    bytes: int = 0  # written to disk
    linked: int = 0  # unchanged shards hard-linked to the previous checkpoint instead of written
    last_blocked_s: float = 0.0
    last_total_s: float = 0.0  # blocked + persist time of the newest save
    slowest_s: float = 0.0  # the longest blocked + persist time of a save so far (the watchdog's save bound)

    def summary(self) -> str:
        per_save = self.blocked_s / self.saves * 1000 if self.saves else 0.0
        return (f"{self.saves} checkpoint(s), training blocked {self.blocked_s:.3f}s in total "
                f"({per_save:.1f} ms per save), background saving {self.background_s:.2f}s, "
                f"{self.bytes / 1e6:.1f} MB written"
                + (f", {self.linked / 1e6:.1f} MB of unchanged shards linked" if self.linked else ""))


@dataclass
class _Flight:
    """The save in flight: its thread, set ``done`` when it ended, set ``abandoned`` when given up on."""

    thread: threading.Thread
    done: threading.Event
    abandoned: threading.Event


class CheckpointWriter:
    def __init__(self, asynchronous: bool = True) -> None:
        self.asynchronous = asynchronous
        self.stats = SaveStats()
        self._flight: _Flight | None = None
        self._error: BaseException | None = None
        self._label = ""
        self.abandoned_thread: threading.Thread | None = None  # a save given up while still running

    def submit(self, label: str, job: Callable[[], int], blocked_since: float,
               abandoned: threading.Event | None = None) -> None:
        """Run ``job`` (which returns the bytes it wrote) inline or in the background.

        ``blocked_since`` is when the training thread entered save(); the time until the job is handed
        off counts as blocked time. ``abandoned``: set by :meth:`abandon`; the job asks it before it commits.
        """
        self.wait()
        self._label = label
        abandoned = abandoned or threading.Event()
        if not self.asynchronous:
            started = time.perf_counter()
            self._run(job, abandoned)
            self._account(blocked=time.perf_counter() - blocked_since, persist=time.perf_counter() - started)
            self.check()
            return
        self._account(blocked=time.perf_counter() - blocked_since, persist=0.0)
        done = threading.Event()
        thread = threading.Thread(target=self._background, args=(job, done, abandoned), name="resumable-save",
                                  daemon=True)
        self._flight = _Flight(thread, done, abandoned)
        thread.start()

    def _run(self, job: Callable[[], int], abandoned: threading.Event) -> None:
        try:
            self.stats.bytes += job()
        except BaseException as e:  # reported on the training thread, unless nobody waits for this save any more
            if not abandoned.is_set():
                self._error = e

    def _background(self, job: Callable[[], int], done: threading.Event, abandoned: threading.Event) -> None:
        try:
            started = time.perf_counter()
            self._run(job, abandoned)
            if not abandoned.is_set():
                elapsed = time.perf_counter() - started
                self.stats.background_s += elapsed
                self.stats.last_total_s = self.stats.last_blocked_s + elapsed
                self.stats.slowest_s = max(self.stats.slowest_s, self.stats.last_total_s)
        finally:
            done.set()

    def _account(self, blocked: float, persist: float) -> None:
        self.stats.saves += 1
        self.stats.blocked_s += blocked
        self.stats.background_s += persist
        self.stats.last_blocked_s = blocked
        self.stats.last_total_s = blocked + persist
        self.stats.slowest_s = max(self.stats.slowest_s, self.stats.last_total_s)

    # Waits use the save's own Event, not Thread.join: a join that a signal handler interrupts (a second Ctrl-C)
    # marks a thread that is still running as stopped on Python 3.11 (the bpo-45274 clean-up), so a stuck save
    # would then look finished.
    @property
    def busy(self) -> bool:
        return self._flight is not None and not self._flight.done.is_set()

    def wait_idle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the save in flight to end (from another thread: reports nothing,
        changes nothing); True when none is running."""
        flight = self._flight
        return flight is None or flight.done.wait(timeout)

    def check(self) -> None:
        """Raise SaveFailed if a finished save failed. Cheap enough to call every step."""
        if self._error is not None and not self.busy:
            error, self._error = self._error, None
            raise SaveFailed(f"saving the checkpoint of {self._label} failed: {error}") from error

    @property
    def label(self) -> str:
        """What the newest save saves (``step N``)."""
        return self._label

    def abandon(self) -> bool:
        """Give up on the save in flight (stuck): it does not commit, and nothing waits for it again. Returns
        whether one was in flight."""
        flight = self._flight
        if flight is None or flight.done.is_set():
            return False
        self._flight = None
        flight.abandoned.set()
        self._error = None  # its outcome is nobody's any more
        self.abandoned_thread = flight.thread  # still running: a new session on this run dir waits for it
        return True

    def wait(self, on_wait: Callable[[float], None] | None = None) -> None:
        """Block until no save is in flight, then report its failure, if any. ``on_wait(waited_s)`` is called every
        0.1 s while it waits (from this thread)."""
        flight = self._flight
        if flight is not None:
            started = time.monotonic()
            while not flight.done.wait(0.1):
                if on_wait is not None:
                    on_wait(time.monotonic() - started)
            flight.thread.join()  # it has ended: only its last instructions are left
            self._flight = None
        self.check()
