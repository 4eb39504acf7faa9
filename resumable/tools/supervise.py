"""`resumable run`: supervise a resumable script, restarting it after a crash or a hang.

The script (``FILE.py``, or ``MODULE:FUNCTION``) runs as a child process whose output goes straight to this
process's stdout and stderr (nothing is captured: a Colab ``!resumable run train.py`` cell shows it live). Its exit
code decides what comes next (:func:`classify`):

- 0 done, 75 a planned stop with its state committed (a signal, the time limit), 74 done or stopped but the newest
  checkpoint not durable on Drive (run again on this machine to upload it: a restart here could loop on a Drive that
  is down), 77 a crash loop (the engine refused to start), 2 bad input, 130 or death by SIGINT (a user's Ctrl-C):
  stop, and exit with that code;
- 76 (a hang: the engine's watchdog), any other code, or death by another signal: a crash, restarted after a backoff
  (:func:`backoff_s`) from the newest committed checkpoint, at most ``max_restarts`` times.

SIGINT, SIGTERM and SIGHUP are forwarded to the child (it commits a checkpoint and exits 75); no restart follows,
and the supervisor exits with the child's code. The child runs in its own process group, so a terminal's Ctrl-C
reaches it once (forwarded), not twice (a second SIGINT would stop it without its final save).

A ``time_limit`` covers the whole supervised session: each child gets the absolute deadline in
``$RESUMABLE_DEADLINE`` (platforms.DEADLINE_ENV), which its session budget honours (the earlier of it and the
script's own limit), and no restart starts with less than ``min_session_s`` left after its backoff.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from ..config import format_duration
from ..errors import EXIT_CRASH_LOOP, EXIT_HANG, EXIT_INTERRUPTED, EXIT_NOT_DURABLE, EXIT_RESUME, EXIT_USAGE
from ..platforms import DEADLINE_ENV, deadline_left_s

FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP")
PREFIX = "resumable run"
# What the child runs: the script as __main__, or MODULE:FUNCTION imported and called (see call_target).
_BOOT = ("import sys; from resumable.tools.supervise import call_target; "
         "sys.exit(call_target(sys.argv[1], sys.argv[2:]))")

_STOPS = {
    0: "the script finished",
    EXIT_RESUME: "the script stopped early with its state committed (exit 75: a signal or its time limit); run again "
                 "to continue",
    EXIT_NOT_DURABLE: "the script ended but its newest checkpoint is not durable on Drive (exit 74); run the same "
                      "command again on this machine to upload it",
    EXIT_CRASH_LOOP: "the engine refused to start: a crash loop (exit 77; its message above says what to fix)",
    EXIT_USAGE: "the script refused its input (exit 2; its message above says what to fix); a restart would fail "
                "the same way",
    EXIT_INTERRUPTED: "the script was interrupted (exit 130: a second Ctrl-C)",
}


@dataclass(frozen=True)
class Outcome:
    """What a child's exit means: ``code`` is what the supervisor passes on (128+N for death by signal N),
    ``restart`` whether it is a crash to restart, ``reason`` the words for it."""

    code: int
    restart: bool
    reason: str


def classify(returncode: int) -> Outcome:
    """A child's ``returncode`` (``subprocess``'s: negative for death by a signal) as an :class:`Outcome`.

    >>> classify(76).restart, classify(75).restart, classify(-9).code
    (True, False, 137)
    """
    if returncode < 0:
        number = -returncode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        if name == "SIGINT":
            return Outcome(128 + number, False, "the script was interrupted (SIGINT)")
        why = {"SIGKILL": " (out of memory? kill -9?)", "SIGSEGV": " (a crash in native code)"}.get(name, "")
        return Outcome(128 + number, True, f"the script was killed by {name}{why}")
    if returncode in _STOPS:
        return Outcome(returncode, False, _STOPS[returncode])
    if returncode == EXIT_HANG:
        return Outcome(returncode, True, "the script hung (exit 76: no step within its hang timeout, stacks in "
                                         "RUN_DIR/hang-*.txt)")
    if returncode == 1:
        return Outcome(1, True, "the script failed (exit 1: an uncaught exception, its traceback is above)")
    return Outcome(returncode, True, f"the script failed (exit {returncode})")


def backoff_s(restart: int, first_s: float, cap_s: float) -> float:
    """The wait before restart number ``restart`` (1-based): ``first_s``, doubling each time, at most ``cap_s``.

    >>> [backoff_s(n, 5, 30) for n in (1, 2, 3, 4, 5)]
    [5.0, 10.0, 20.0, 30.0, 30.0]
    """
    return float(min(first_s * 2 ** min(restart - 1, 60), cap_s))


def too_little_left(left_s: float | None, wait_s: float, min_session_s: float) -> bool:
    """Whether a restart after ``wait_s`` would have less than ``min_session_s`` of ``left_s`` (None: no limit).

    >>> too_little_left(None, 5, 60), too_little_left(100, 5, 60), too_little_left(60, 5, 60)
    (False, False, True)
    """
    return left_s is not None and left_s - wait_s < min_session_s


def deadline_for(time_limit_s: float | None, now: float) -> float | None:
    """The absolute deadline (Unix time) of a session that starts ``now``: ``now + time_limit_s``, or an inherited
    ``$RESUMABLE_DEADLINE`` when that is earlier (a supervisor under a supervisor); None when neither is set."""
    inherited = deadline_left_s(now)
    candidates = [now + s for s in (time_limit_s, inherited) if s is not None]
    return min(candidates) if candidates else None


def child_command(target: str, args: Sequence[str], python: str = sys.executable) -> list[str]:
    """The command line of one child (the boot: :func:`call_target`); ValueError naming the fix for a target that
    is neither ``FILE.py`` nor ``MODULE:FUNCTION`` (or ``FILE.py:FUNCTION``)."""
    where, colon, function = target.rpartition(":")
    if target.endswith(".py") or (not colon and os.sep in target):
        if not Path(target).is_file():
            raise ValueError(f"there is no script {target!r} (relative to {os.getcwd()}); give the path of your "
                             f"training script, e.g. resumable run train.py -- --lr 3e-4")
        target = str(Path(target).resolve())
    elif not colon:
        raise ValueError(f"{target!r} is neither a script (FILE.py) nor MODULE:FUNCTION; e.g. resumable run "
                         f"train.py -- ARGS, or resumable run mypkg.train:main -- ARGS")
    elif not all(p.isidentifier() for p in function.split(".")):
        raise ValueError(f"{target!r}: {function!r} after the colon is not a function name; e.g. mypkg.train:main")
    elif where.endswith(".py"):
        if not Path(where).is_file():
            raise ValueError(f"there is no script {where!r} (relative to {os.getcwd()}) for {target!r}")
        target = f"{Path(where).resolve()}:{function}"
    elif not all(p.isidentifier() for p in where.split(".")):
        raise ValueError(f"{target!r}: {where!r} is not a module name; e.g. mypkg.train:main")
    return [python, "-u", "-c", _BOOT, target, *args]


def call_target(target: str, args: list[str]) -> int:
    """In the child: run ``FILE.py`` as ``__main__`` (as ``python FILE.py`` does), or import ``MODULE`` (or
    ``FILE.py``) and call ``FUNCTION()``, with ``sys.argv = [FILE or MODULE, *args]``; a function's int return value
    (or the ``exit_code`` of what it returns, e.g. a Run) is the exit code, and ``sys.exit`` works as usual.

    An uncaught :class:`~resumable.errors.ResumableError` is reported as Python reports it (the traceback, and the
    session's end recorded through ``sys.excepthook``), then ends the child with its documented code instead of
    Python's 1: 77 for a crash loop, 2 for bad input, so that the supervisor stops instead of restarting. Any other
    exception is Python's own: its traceback and exit 1."""
    from ..errors import ResumableError
    from .forkserver import _exit_code, load

    try:
        program, function = load(target)
    except Exception as e:  # noqa: BLE001 - a bad target, not a training failure: exit 2 stops the supervisor
        print(f"{PREFIX}: cannot load {target}: {type(e).__name__}: {e}. Check the module is importable from "
              f"{os.getcwd()} (or installed) and has that function", file=sys.stderr)
        return EXIT_USAGE
    sys.argv = [program, *args]
    try:
        return _exit_code(function(list(args)) if ":" not in target else function())
    except ResumableError as e:
        sys.excepthook(type(e), e, e.__traceback__)
        return e.exit_code


def _child_setup(prctl: Callable[..., int] | None) -> Callable[[], None]:
    """What the child runs between fork and exec: its own process group (a terminal's Ctrl-C reaches only the
    supervisor, which forwards it once) and, on Linux, SIGTERM when the supervisor dies without forwarding
    (SIGKILL): the child then commits a checkpoint and exits 75 instead of training on unsupervised."""

    def setup() -> None:  # pragma: no cover - runs in the child
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return setup


def _prctl() -> Callable[..., int] | None:
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child between fork and exec only calls it
    except (OSError, AttributeError):
        return None


@dataclass(frozen=True)
class Policy:
    """How `resumable run` restarts: see the command's options (resumable/cli/commands.py)."""

    max_restarts: int = 3
    backoff_s: float = 5.0
    backoff_max_s: float = 300.0
    time_limit_s: float | None = None
    min_session_s: float = 120.0


class Supervisor:
    """Runs ``command`` until it stops (see the module doc); :meth:`run` returns the exit code to end with.

    ``echo`` prints one line (stderr); ``sleep`` and ``clock`` (Unix time) are seams for tests."""

    def __init__(self, command: list[str], policy: Policy, env: dict[str, str] | None = None,
                 echo: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.time) -> None:
        self.command, self.policy, self.echo, self.sleep, self.clock = command, policy, echo, sleep, clock
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("PYTHONUNBUFFERED", "1")  # the child's lines reach a notebook cell as they are printed
        self.deadline = deadline_for(policy.time_limit_s, clock())
        if self.deadline is not None:
            self.env[DEADLINE_ENV] = f"{self.deadline:.3f}"
        self.child: subprocess.Popen | None = None
        self.stopping: str | None = None  # the first forwarded signal's name: no restart after it
        self.restarts = 0
        self._setup = _child_setup(_prctl())

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = self.stopping or signal.Signals(signum).name
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(self.command, env=self.env, preexec_fn=self._setup)  # noqa: PLW1509 - one thread

    def run(self) -> int:
        previous = {name: signal.signal(getattr(signal, name), self._forward) for name in FORWARDED}
        try:
            return self._loop()
        finally:
            for name, handler in previous.items():
                signal.signal(getattr(signal, name), handler)

    def _loop(self) -> int:
        while True:
            self.child = self._start()
            if self.stopping:  # a signal between the start and this line found no child to forward to
                self.child.send_signal(getattr(signal, self.stopping))
            outcome = classify(self.child.wait())
            if self.stopping:
                self.echo(f"{PREFIX}: {self.stopping} forwarded; {outcome.reason}; not restarting "
                          f"(exit {outcome.code})")
                return outcome.code
            if not outcome.restart:
                return outcome.code
            if self.restarts >= self.policy.max_restarts:
                self.echo(f"{PREFIX}: {outcome.reason}; not restarting: all {self.policy.max_restarts} restart(s) used "
                          f"(--max-restarts); exit {outcome.code}")
                return outcome.code
            self.restarts += 1
            wait = backoff_s(self.restarts, self.policy.backoff_s, self.policy.backoff_max_s)
            left = None if self.deadline is None else self.deadline - self.clock()
            if too_little_left(left, wait, self.policy.min_session_s):
                self.echo(f"{PREFIX}: {outcome.reason}; not restarting: {format_duration(max(left or 0.0, 0.0))} of "
                          f"--time-limit left, less than --min-session {format_duration(self.policy.min_session_s)} "
                          f"after a {format_duration(wait)} backoff; exit {outcome.code}")
                return outcome.code
            self.echo(f"{PREFIX}: restart {self.restarts}/{self.policy.max_restarts} in {_seconds(wait)}: "
                      f"{outcome.reason}")
            if self._wait(wait):
                self.echo(f"{PREFIX}: {self.stopping} during the backoff; not restarting (exit {EXIT_RESUME}: the "
                          f"newest committed checkpoint is intact, run again to continue)")
                return EXIT_RESUME

    def _wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` (the backoff); True as soon as a stop signal arrives."""
        end = time.monotonic() + seconds
        while not self.stopping and (left := end - time.monotonic()) > 0:
            self.sleep(min(left, 0.1))
        return bool(self.stopping)


def _seconds(seconds: float) -> str:
    return format_duration(seconds) if seconds >= 1 else f"{seconds:.1f}s"
