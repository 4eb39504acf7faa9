"""Faults injected on purpose, for `resumable chaos` and the tests: one object handed to the engine.

Production code never reads test variables; it asks the :class:`Faults` it was given. A child process that
chaos starts gets its faults through one variable, ``RESUMABLE_FAULTS`` (JSON), read only by
:meth:`Faults.from_env` where a :class:`~resumable.engine.run.Run` is built without explicit faults.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, fields

FAULTS_ENV = "RESUMABLE_FAULTS"


@dataclass(frozen=True)
class Faults:
    """``save_delay_s``: sleep between a checkpoint's payload and its manifest (widens the window a kill can
    land in). ``shard_delay_s``: sleep after each shard of a sharded checkpoint is on disk (a kill lands inside a
multi-shard write). ``skip_rng_restore``: resume without restoring RNG states (a deliberately broken engine, which
    chaos must report as DIVERGED)."""

    save_delay_s: float = 0.0
    skip_rng_restore: bool = False
    shard_delay_s: float = 0.0

    @classmethod
    def from_env(cls) -> Faults:
        text = os.environ.get(FAULTS_ENV)
        if not text:
            return NO_FAULTS
        try:
            data = json.loads(text)
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in data.items() if k in known})
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{FAULTS_ENV}={text!r} is not a JSON object of {sorted(f.name for f in fields(cls))}"
                             ) from e

    def to_env(self) -> dict[str, str]:
        """The environment that hands these faults to a child process."""
        return {FAULTS_ENV: json.dumps(asdict(self))}

    def before_commit(self) -> None:
        if self.save_delay_s > 0:
            time.sleep(self.save_delay_s)

    def between_shards(self) -> None:
        if self.shard_delay_s > 0:
            time.sleep(self.shard_delay_s)


NO_FAULTS = Faults()
