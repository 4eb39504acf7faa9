"""Faults injected on purpose, for `resumable chaos` and the tests: a hook whose default injects nothing.

The engine never reads the environment for faults: a :class:`~resumable.engine.run.Run` uses those it is handed
(``Run._for_tool(ToolHooks(faults=...))``, the tests) or else this process's hook (:func:`installed`, no faults
unless something called :func:`install`). A process that chaos starts gets its faults through ``RESUMABLE_FAULTS``
(JSON) with ``RESUMABLE_FAULTS_ARMED=1`` beside it and chaos's child bootstrap on PYTHONPATH (all three from
:meth:`Faults.to_env`): the bootstrap (tools/bootstrap/sitecustomize.py) reads them at start-up and installs them,
and chaos's fork server does the same for each child it forks (:func:`install_from_env`). A ``RESUMABLE_FAULTS`` left
in an environment by hand (without the armed mark) is ignored with a warning: a stray ``skip_rng_restore`` would
otherwise turn off the RNG restore and its check in silence. Faults that are obeyed are said at every start
(:meth:`Faults.describe`).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, fields

FAULTS_ENV = "RESUMABLE_FAULTS"
ARMED_ENV = "RESUMABLE_FAULTS_ARMED"  # "1": resumable chaos (or a test, through to_env) put the faults there


@dataclass(frozen=True)
class Faults:
    """``save_delay_s``: sleep between a checkpoint's payload and its manifest (widens the window a kill can
    land in). ``shard_delay_s``: sleep after each shard of a sharded checkpoint is on disk (a kill lands inside a
multi-shard write). ``skip_rng_restore``: resume without restoring RNG states (a deliberately broken engine, which
    chaos must report as DIVERGED; it skips the check that the RNG streams were restored, too). ``kill_at_step``:
    SIGKILL this process right after that optimizer step, before anything is saved at its boundary (a kill at an
    exact step: e.g. the first step after a resume). ``kill_in_save_at_step``: SIGKILL it inside the save of that
    step, after the payload is written and before the manifest commits it. ``hang_at_step``: block forever right
    after that step (a hung collective or data loader, for the watchdog). ``raise_at_step``: raise RuntimeError
    right after that step, every session (a step that always fails: a crash loop). ``ignore_crash_loop``: start even
    when the last sessions look like a crash loop (chaos kills sessions on purpose, before they commit anything).
    ``hang_after_s``: like ``hang_at_step``, once that many seconds have passed since this session's first step.
    ``save_error_after_s``: the first checkpoint committed that long after the first step fails with EIO instead
    (a disk or writer error; the run goes on). ``save_hold_file``: while that file exists, a save that reaches
    its manifest first writes ``<file>.held`` and then waits (at most ``HOLD_LIMIT_S``): chaos creates the file when
    a kill inside a checkpoint write is due and kills once the save is held, so the kill is sure to land between
    payload and manifest, however late the killer is scheduled, and no save is slowed before then."""

    save_delay_s: float = 0.0
    skip_rng_restore: bool = False
    shard_delay_s: float = 0.0
    kill_at_step: int | None = None
    kill_in_save_at_step: int | None = None
    hang_at_step: int | None = None
    raise_at_step: int | None = None
    ignore_crash_loop: bool = False
    hang_after_s: float | None = None
    save_error_after_s: float | None = None
    save_hold_file: str | None = None

    def __post_init__(self) -> None:
        # when this process trained its first step, and which timed faults have fired: each Faults its own
        object.__setattr__(self, "_clock", {})

    @classmethod
    def from_env(cls) -> Faults:
        text = os.environ.get(FAULTS_ENV)
        if not text:
            return NO_FAULTS
        if os.environ.get(ARMED_ENV) != "1":
            from . import log

            if text in _WARNED:
                return NO_FAULTS
            _WARNED.add(text)
            log.warning(f"{FAULTS_ENV} is set ({text[:80]}) but was not armed by resumable chaos ({ARMED_ENV}=1): "
                        f"ignored, this is a normal run. Unset {FAULTS_ENV} to silence this")
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
        path = os.pathsep.join(p for p in (BOOTSTRAP, os.environ.get("PYTHONPATH")) if p)
        return {FAULTS_ENV: json.dumps(asdict(self)), ARMED_ENV: "1", "PYTHONPATH": path}

    def describe(self) -> str:
        """The faults set, for the line every start that obeys them prints ("" for none)."""
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                         if getattr(self, f.name) != f.default)

    def before_commit(self, step: int | None = None, abandoned: threading.Event | None = None) -> None:
        """``abandoned``: the session gave up on this save; a held save stops waiting then."""
        if self.save_delay_s > 0:
            time.sleep(self.save_delay_s)
        if self.save_hold_file is not None and os.path.exists(self.save_hold_file):
            _hold(self.save_hold_file, abandoned)
        if step is not None and step == self.kill_in_save_at_step:
            _die()
        if self._due(self.save_error_after_s, "save error"):
            raise OSError(errno.EIO, f"Input/output error (injected: {FAULTS_ENV} save_error_after_s)")

    def after_step(self, step: int) -> None:
        self._clock.setdefault("first step", time.monotonic())
        if step == self.kill_at_step:
            _die()
        if step == self.raise_at_step:
            raise RuntimeError(f"planted failure at step {step} (Faults.raise_at_step)")
        if step == self.hang_at_step:
            _hang()
        if self._due(self.hang_after_s, "hang"):
            _hang()

    def between_shards(self) -> None:
        if self.shard_delay_s > 0:
            time.sleep(self.shard_delay_s)

    def _due(self, after_s: float | None, name: str) -> bool:
        """Whether a timed fault fires now: ``after_s`` seconds after the first step, once per process."""
        clock = self._clock
        first = clock.get("first step")
        if after_s is None or first is None or name in clock or time.monotonic() - first < after_s:
            return False
        clock[name] = time.monotonic()
        return True


_WARNED: set[str] = set()  # unarmed RESUMABLE_FAULTS values already warned about (once per process)
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "bootstrap")  # chaos's child bootstrap
_INSTALLED: Faults | None = None


def install(faults: Faults) -> None:
    """This process's fault hook: what a Run without faults of its own injects (see the module docstring)."""
    global _INSTALLED
    _INSTALLED = faults


def installed() -> Faults:
    """The installed faults; none by default."""
    return _INSTALLED if _INSTALLED is not None else NO_FAULTS


def install_from_env() -> Faults:
    """Chaos's child bootstrap: the faults the environment hands this process (armed only), installed."""
    faults = Faults.from_env()
    install(faults)
    return faults


def _die() -> None:
    """SIGKILL this process at once, as a VM that goes away does (no handler, no cleanup)."""
    os.kill(os.getpid(), signal.SIGKILL)


HOLD_LIMIT_S = 300.0  # a held save goes on by itself if nobody kills it (the killer died)


def held_marker(hold: str | os.PathLike) -> str:
    """The file a save held by ``hold`` (``save_hold_file``) writes to say so."""
    return f"{os.fspath(hold)}.held"


def _hold(path: str, abandoned: threading.Event | None = None) -> None:
    """Say that a save is held (:func:`held_marker`), then wait while ``path`` exists (and the save is not
    abandoned)."""
    held = held_marker(path)
    with open(held, "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + HOLD_LIMIT_S
    while os.path.exists(path) and time.monotonic() < deadline and not (abandoned is not None and abandoned.is_set()):
        time.sleep(0.01)
    try:
        os.unlink(held)
    except FileNotFoundError:
        pass


def _hang() -> None:
    """Block this thread forever, as a lost collective or a stuck data loader does."""
    while True:
        time.sleep(3600)


NO_FAULTS = Faults()
