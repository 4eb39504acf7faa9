"""How fast checkpoints become durable remotely: a rolling measure of the mirror's uploads, and from it how long
the next checkpoint would take to get there (the session budget reserves that before the time limit)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class UploadPace:
    """Bytes and seconds of the last ``window`` checkpoint uploads, and the upload in flight.

    A checkpoint upload is timed whole (listing, payload, logs, manifest), so the per-request cost of small
    files is in the rate; successive checkpoints of a run have about the same size, which makes "its bytes at
    that rate" a fair estimate of the next one.

    >>> pace = UploadPace(clock=iter([0.0, 2.0]).__next__)
    >>> pace.begin(10_000_000); pace.sent(10_000_000); pace.end()
    >>> pace.durable_s()
    2.0
    """

    def __init__(self, window: int = 5, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._done: deque[tuple[int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._total = 0  # bytes the upload in flight sends in all (0: none in flight)
        self._sent = 0
        self._started = 0.0
        self._active = False
        self.last_bytes = 0  # bytes the newest finished checkpoint upload sent

    def begin(self, total_bytes: int) -> None:
        with self._lock:
            self._total, self._sent, self._started = total_bytes, 0, self.clock()
            self._active = True

    def skip(self, nbytes: int) -> None:
        """Bytes of the upload in flight that need not be sent after all (already durable elsewhere)."""
        with self._lock:
            self._total = max(self._total - nbytes, 0)

    def sent(self, nbytes: int) -> None:
        with self._lock:
            self._sent += nbytes

    def end(self, completed: bool = True) -> None:
        """The upload in flight ended; when it ``completed``, it is measured."""
        with self._lock:
            if completed and self._active:
                self._done.append((self._sent, max(self.clock() - self._started, 1e-6)))
                self.last_bytes = self._sent
            self._total = self._sent = 0
            self._active = False

    def rate(self) -> float | None:
        """Bytes/s of the recent checkpoint uploads (None: none finished yet)."""
        with self._lock:
            seconds = sum(s for _, s in self._done)
            return sum(b for b, _ in self._done) / seconds if self._done else None

    def durable_s(self, checkpoints: int = 1) -> float:
        """Seconds until the last of ``checkpoints`` committed from now on would be durable remotely: the rest of
        the upload in flight (the mirror finishes it first), then one checkpoint's bytes each (a checkpoint
        committed while the mirror is idle starts uploading at once, so a final one committed after it waits
        for it). 0 until one upload was measured."""
        rate = self.rate()
        if rate is None:
            return 0.0
        with self._lock:
            left = max(self._total - self._sent, 0)
            size = self.last_bytes or self._total
        return (left + checkpoints * size) / rate
