"""Runs checkpoint persistence inline or on one background thread, and accounts for its cost.

At most one save is in flight: ``submit`` waits for the previous one first. An exception raised by a
background save is kept and raised on the training thread by the next ``check``/``wait``/``submit``,
as :class:`SaveFailed`; a failed save never writes a manifest, so it never counts as a checkpoint.
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

    def summary(self) -> str:
        per_save = self.blocked_s / self.saves * 1000 if self.saves else 0.0
        return (f"{self.saves} checkpoint(s), training blocked {self.blocked_s:.3f}s in total "
                f"({per_save:.1f} ms per save), background saving {self.background_s:.2f}s, "
                f"{self.bytes / 1e6:.1f} MB written"
                + (f", {self.linked / 1e6:.1f} MB of unchanged shards linked" if self.linked else ""))


class CheckpointWriter:
    def __init__(self, asynchronous: bool = True) -> None:
        self.asynchronous = asynchronous
        self.stats = SaveStats()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._label = ""

    def submit(self, label: str, job: Callable[[], int], blocked_since: float) -> None:
        """Run ``job`` (which returns the bytes it wrote) inline or in the background.

        ``blocked_since`` is when the training thread entered save(); the time until the job is handed
        off counts as blocked time.
        """
        self.wait()
        self._label = label
        if not self.asynchronous:
            started = time.perf_counter()
            self._run(job)
            self._account(blocked=time.perf_counter() - blocked_since, persist=time.perf_counter() - started)
            self.check()
            return
        self._account(blocked=time.perf_counter() - blocked_since, persist=0.0)
        self._thread = threading.Thread(target=self._background, args=(job,), name="resumable-save",
                                        daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], int]) -> None:
        try:
            self.stats.bytes += job()
        except BaseException as e:  # reported on the training thread
            self._error = e

    def _background(self, job: Callable[[], int]) -> None:
        started = time.perf_counter()
        self._run(job)
        elapsed = time.perf_counter() - started
        self.stats.background_s += elapsed
        self.stats.last_total_s = self.stats.last_blocked_s + elapsed

    def _account(self, blocked: float, persist: float) -> None:
        self.stats.saves += 1
        self.stats.blocked_s += blocked
        self.stats.background_s += persist
        self.stats.last_blocked_s = blocked
        self.stats.last_total_s = blocked + persist

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_idle(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the save in flight to end (from another thread: reports nothing,
        changes nothing); True when none is running."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def check(self) -> None:
        """Raise SaveFailed if a finished save failed. Cheap enough to call every step."""
        if self._error is not None and not self.busy:
            error, self._error = self._error, None
            raise SaveFailed(f"saving the checkpoint of {self._label} failed: {error}") from error

    def wait(self) -> None:
        """Block until no save is in flight, then report its failure, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()
