"""Chaos with a Drive run dir (``--run-dir gdrive://.../{run_dir}`` in the training options): where each scratch
run lives on Drive and in the local cache chaos watches, the fault proxy its sessions talk through
(``--fault drive``, and ``mix``), and the final check that the newest checkpoint is durable on Drive.

``{run_dir}`` in a gdrive:// argument becomes ``<workdir name>/chaos`` or ``<workdir name>/reference``, so two
chaos runs (two workdirs) never share a Drive folder. `resumable-train` gets ``--cache-dir <workdir>/drive-cache``
unless its options name one: chaos reads each run's checkpoints and metrics from that cache, as it reads a local
run dir. Only the chaos sessions talk through the proxy; the uninterrupted reference talks to Drive directly.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from ..checkpoint import CheckpointManager, checkpoints_dir
from ..storage import StorageError, cache_path, open_run_location
from ..storage.gdrive import is_drive_url
from ..storage.restore import restore_newest
from .chaos_report import Kill
from .faultproxy import KINDS, FaultProxy, Fired
from .targets import Target

ENDPOINT = "RESUMABLE_DRIVE_ENDPOINT"
GOOGLE_API = "https://www.googleapis.com"  # what auth.py's EndpointHttp rewrites: the base, no path
RECOVERY_WAIT_S = 3.0  # after the client's timeout and retry waits, how long chaos waits to see a fault dealt with


def drive_run_dir(target: Target, run_dir: Path) -> str | None:
    """The gdrive:// run dir a session of ``target`` in ``run_dir`` trains into, or None."""
    args = target.arguments(run_dir, False)
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--run-dir" and i + 1 < len(args) else arg.removeprefix("--run-dir=")
        if is_drive_url(value):
            return value
    return None


def _option(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


class DriveRuns:
    """The Drive side of one chaos run: where its runs are, the proxy, the faults injected through it."""

    def __init__(self, target: Target, workdir: Path, rng: random.Random, env: Mapping[str, str]) -> None:
        if target.kind != "resumable-train":
            raise ValueError("a gdrive:// run dir works in chaos with --target resumable-train only (chaos gives "
                             "it --cache-dir to watch the checkpoints); train your own target into a local "
                             "{run_dir} or a mounted Drive folder")
        self.target = target
        self.rng = rng
        self.given_cache = _option(list(target.args), "--cache-dir")
        self.cache = Path(self.given_cache) if self.given_cache else workdir / "drive-cache"
        self.workdir = workdir
        self.upstream = env.get(ENDPOINT) or GOOGLE_API
        # A stall holds its answer past the client's HTTP timeout, so the client gives up and retries.
        self.timeout_s = float(env.get("RESUMABLE_DRIVE_TIMEOUT") or 60)
        self.proxy = FaultProxy(self.upstream, stall_s=self.timeout_s + 1.0)  # started for the first session
        self._started = False
        self._bag: list[str] = []  # each Drive fault kind once before any repeats

    def url(self, run_dir: Path) -> str:
        url = drive_run_dir(self.target, run_dir)
        assert url is not None, "DriveRuns is only made for a Drive run dir"
        return url

    def local(self, run_dir: Path) -> Path:
        """The local cache of the scratch run ``run_dir``: where chaos reads its checkpoints and metrics."""
        return cache_path(self.url(run_dir), self.cache)

    def arguments(self, args: list[str]) -> list[str]:
        return args if self.given_cache else [*args, "--cache-dir", str(self.cache)]

    def session_env(self) -> dict[str, str]:
        """What a chaos session (not the reference) gets: its Drive calls go through the fault proxy."""
        if not self._started:
            self.proxy.start()
            self._started = True
        return {ENDPOINT: self.proxy.url}

    def close(self) -> None:
        if self._started:
            self.proxy.stop()
            self._started = False

    def inject(self, number: int, running: Callable[[], bool], step: Callable[[], int]) -> Kill | None:
        """Fail the session's next Drive call and wait until it is dealt with (or the session ends): the report
        row, or None when the session ended before it made another Drive call."""
        assert self._started, "session_env() starts the proxy"
        if not self._bag:
            self._bag = self.rng.sample(KINDS, len(KINDS))
        kind = self._bag[-1]
        count = len(self.proxy.fired)
        self.proxy.arm(kind)
        while running() and len(self.proxy.fired) == count:
            time.sleep(0.005)
        if len(self.proxy.fired) == count:
            self.proxy.disarm()
            return None
        self._bag.pop()
        fired = self.proxy.fired[count]
        at = step()
        # The client's wait: its timeout after a stall, then the backoff before the retry.
        deadline = time.monotonic() + (self.timeout_s if kind == "stall" else 0) + RECOVERY_WAIT_S * 10
        while fired.recovered_at is None and running() and time.monotonic() < deadline:
            time.sleep(0.01)
        return Kill(number, kind.upper(), False, at, fault="drive", ended_session=False, retries=fired.retries,
                    recovered_s=fired.recovered_s, note=_note(fired))

    def restore(self, run_dir: Path, name: str) -> Path:
        """Bring the newest checkpoint durable on Drive of ``run_dir`` into a fresh cache (directly, not through
        the proxy); the local folder to read it from."""
        try:
            location = open_run_location(self.url(run_dir), str(self.workdir / name))
            assert location.remote is not None
            restore_newest(location.remote, CheckpointManager(checkpoints_dir(location.local_dir)),
                           location.local_dir, lambda _: None)
        except StorageError as e:
            raise RuntimeError(f"cannot read the chaos run back from Drive to check its newest checkpoint: {e}") from e
        return location.local_dir


def _note(fired: Fired) -> str:
    what = fired.request
    if fired.recovered_at is None:
        return f"{what}: not answered again before the session ended (the next pass retries)"
    if fired.continued_at is not None:
        return f"{what}: went on from byte {fired.continued_at}, which Drive had acknowledged (status query)"
    return f"{what}: retried"
