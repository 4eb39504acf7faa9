"""Retrying transient storage errors with truncated exponential backoff and jitter that never retries at once."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..envvars import env_number

T = TypeVar("T")


class StorageError(Exception):
    """A storage operation failed for good; the message says what to do."""


class MissingFile(StorageError):
    """The file or folder is not there (deleted meanwhile, or never uploaded)."""


class TransientStorageError(StorageError):
    """A failure worth retrying (rate limit, 5xx, reset connection, timeout, a dropped mount)."""


@dataclass
class RetryPolicy:
    """``attempts`` tries in all; before retry k (0 first) waits between half and all of ``base_s``·2^(k+1),
    capped at ``max_s``: 1-2 s, 2-4 s, 4-8 s, ... 32-64 s with the defaults.

    "Equal jitter": half the wait is fixed, so even the first retry waits at least ``base_s`` (Google's guidance
    for its APIs: 1 s plus jitter, then doubling; a rate limit answered by an immediate retry is answered again),
    and the other half is random, so that processes failing together spread out. The floor scales with
    ``base_s``: tests set RESUMABLE_RETRY_BASE_S=0.01 and wait 10-20 ms.
    """

    attempts: int = 8
    base_s: float = 1.0
    max_s: float = 64.0
    sleep: Callable[[float], None] = time.sleep
    retries: int = field(default=0, compare=False)  # retries performed, for reporting
    # Jitter has its own generator: retries run on the mirror's thread, and drawing from the global
    # ``random`` would make a network fault change the training run's Python RNG stream (and so a resume
    # that is no longer bit-identical). Seeded from the OS so that processes retrying together do not
    # draw identical waits.
    _rng: random.Random = field(default_factory=lambda: random.Random(int.from_bytes(os.urandom(16), "big")),
                                init=False, repr=False, compare=False)

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """Defaults, with RESUMABLE_RETRY_BASE_S / RESUMABLE_RETRY_ATTEMPTS overriding (tests use short waits)."""
        return cls(attempts=int(env_number("RESUMABLE_RETRY_ATTEMPTS", cls.attempts, what="a number of attempts",
                                           integer=True)),
                   base_s=env_number("RESUMABLE_RETRY_BASE_S", cls.base_s))

    def delay(self, attempt: int) -> float:
        ceiling = min(self.max_s, self.base_s * 2 ** (attempt + 1))
        return self._rng.uniform(ceiling / 2, ceiling)

    def call(self, action: Callable[[], T], classify: Callable[[BaseException], StorageError | None],
             what: str) -> T:
        """Run ``action``; errors that ``classify`` maps to TransientStorageError are retried.

        ``classify`` returns the StorageError to raise (transient or not) or None for errors that are
        not storage errors at all (programming errors), which propagate unchanged.
        """
        for attempt in range(self.attempts):
            try:
                return action()
            except Exception as e:  # classified below; unknown errors re-raised as they are
                mapped = classify(e)
                if mapped is None:
                    raise
                if not isinstance(mapped, TransientStorageError) or attempt + 1 == self.attempts:
                    suffix = f" after {attempt + 1} attempts" if attempt else ""
                    raise type(mapped)(f"{what} failed{suffix}: {mapped}") from e
                self.retries += 1
                self.sleep(self.delay(attempt))
        raise AssertionError("unreachable")
