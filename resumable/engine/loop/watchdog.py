"""Hang detection: a step watchdog that turns a silent hang into a restartable exit, or, in a notebook, an exception.

A lost NCCL peer, a stuck data-loader worker or a dead file system mount can leave training blocked forever, in C
code that no exception ever leaves. The watchdog is a daemon thread that the loop ticks at every completed
optimizer step (:meth:`Watchdog.beat`). When no step completes for the hang timeout it writes every thread's
stack to ``RUN_DIR/hang-<session>-<rank>.txt``, records the session's end as ``hang`` in sessions.jsonl (rank 0)
and prints one error line. A script then ends with ``os._exit(76)`` (a hung main thread cannot be unwound), so a
supervisor restarts it from the newest committed checkpoint. In an interactive kernel (a notebook) the process is
the user's kernel: the training thread gets a :class:`~resumable.errors.Hung` exception instead (through a signal,
which also breaks a blocking system call), the cell ends with it and every variable survives.

What counts: the clock runs while the loop runs, from the start of the session's training (after the Drive restore
and the checkpoint load) to each step's end. It is paused around ``evaluate()`` at each epoch's end, and idle
whenever control is outside the loop: the loop was left (``break``, an exception), or a notebook cell ended with the
loop suspended; the next step arms it again. It stops before the wait for the last uploads at exit. The first step
of a session gets at least :data:`FIRST_STEP_S` (``torch.compile``, cuDNN autotuning, data-loader workers starting,
NCCL connecting).

Saves are watched too: while the loop waits for a checkpoint save (the copy, the one in flight, the final one) the
bound is ``max(hang timeout, SAVE_FACTOR x the slowest save so far)``; a save stuck on a dead mount is a hang like
any other.

The timeout: ``--hang-timeout DURATION``, or ``auto`` (the default): ``max(10 x p99 of this session's step times,
5 min)``, 5 min until :data:`MIN_SAMPLES` steps are measured. A background save still in flight when the watchdog
fires for a step is given :data:`SAVE_GRACE_S` to commit (an unfinished one is invisible anyway: its manifest is
written last).
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from ... import log
from ...config import format_duration
from ...errors import EXIT_HANG, Hung

FLOOR_S = 300.0  # the auto timeout is never shorter: a slow step on a shared machine is not a hang
FACTOR = 10  # x the p99 step time
MIN_SAMPLES = 20  # steps measured before the p99 is trusted
WINDOW = 1000  # the most recent step times the p99 is taken over
FIRST_STEP_S = 900.0  # the least a session's first step gets
SAVE_GRACE_S = 60.0  # the longest the watchdog waits for a background save to commit before exiting
SAVE_FACTOR = 10  # a save may take this many times the slowest save so far (or the hang timeout) before it is hung


class Overdue(NamedTuple):
    """What the watchdog found hung: ``what`` is "step" (no step completed) or "save" (a save did not finish)."""

    step: int
    waited_s: float
    limit_s: float
    what: str = "step"


def default_timeout(step_times: Sequence[float]) -> float:
    """The auto hang timeout for these measured step times (seconds).

    >>> default_timeout([1.0] * 100)
    300.0
    >>> default_timeout([40.0] * 100)
    400.0
    """
    if len(step_times) < MIN_SAMPLES:
        return FLOOR_S
    ordered = sorted(step_times)
    p99 = ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]
    return max(FACTOR * p99, FLOOR_S)


def write_stacks(path: Path, header: str) -> None:
    """Every thread's Python stack, with thread names, into ``path`` (faulthandler's dump if that fails)."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(header + "\n\n")
        try:
            names = {t.ident: t.name for t in threading.enumerate()}
            me, main = threading.get_ident(), threading.main_thread().ident
            frames = sorted(sys._current_frames().items(), key=lambda item: item[0] != main)  # the main thread first
            for ident, frame in frames:
                if ident == me:
                    continue  # the watchdog itself
                handle.write(f"Thread {names.get(ident, '?')} (0x{ident:x}), most recent call last:\n")
                handle.write("".join(traceback.format_stack(frame)) + "\n")
        except Exception:  # noqa: BLE001 - the C-level dump needs no Python objects of the other threads
            handle.flush()
            faulthandler.dump_traceback(handle, all_threads=True)
        handle.flush()
        os.fsync(handle.fileno())


class Watchdog:
    """Fires ``on_hang(step, waited_s, limit_s, what)`` when no step completes within the limit, or a save the loop
    waits for does not finish within the save bound (see the module doc).

    ``timeout_s`` None: auto (:func:`default_timeout`). ``slowest_save()``: the longest a save of this session took
    so far, in seconds. ``on_hang`` is :class:`HangExit` (a test passes its own)."""

    def __init__(self, timeout_s: float | None, on_hang: Callable[..., None],
                 clock: Callable[[], float] = time.monotonic, slowest_save: Callable[[], float] = lambda: 0.0) -> None:
        self.timeout_s = timeout_s
        self.on_hang = on_hang
        self.clock = clock
        self.slowest_save = slowest_save
        self._lock = threading.Lock()
        self._times: deque[float] = deque(maxlen=WINDOW)
        self._last = clock()
        self._step = 0
        self._first = True
        self._paused = 0
        self._idle = False  # control is outside the loop: nothing to watch until the next step
        self._saving_since: float | None = None  # the loop has been waiting for a save since then
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.hung_on: str | None = None  # "step" or "save" once it fired

    def _timeout(self, times: Sequence[float]) -> float:
        return self.timeout_s if self.timeout_s is not None else default_timeout(times)

    def limit(self) -> float:
        """Seconds the current step may take."""
        with self._lock:
            times = list(self._times)
            first = self._first
        timeout = self._timeout(times)
        return max(timeout, FIRST_STEP_S) if first else timeout

    def save_limit(self) -> float:
        """Seconds the loop may wait for a save: the hang timeout, or :data:`SAVE_FACTOR` x the slowest save."""
        with self._lock:
            times = list(self._times)
        return max(self._timeout(times), SAVE_FACTOR * self.slowest_save())

    def start(self, step: int) -> None:
        """Arm it: the session's first step begins now, after ``step`` steps."""
        with self._lock:
            self._last, self._step, self._first = self.clock(), step, True
        self._thread = threading.Thread(target=self._watch, name="resumable-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        """Step ``step`` completed."""
        now = self.clock()
        with self._lock:
            if not self._first:
                self._times.append(now - self._last)
            self._last, self._step, self._first = now, step, False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A pause resumable makes on purpose (evaluation): not counted; the clock restarts after."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._last = self.clock()

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """The loop waits for a checkpoint save: watched against :meth:`save_limit`; the step clock restarts after."""
        with self._lock:
            self._saving_since = self.clock()
        try:
            yield
        finally:
            with self._lock:
                self._saving_since = None
                self._last = self.clock()

    def idle(self) -> None:
        """Control is outside the loop (a notebook cell ended with it suspended): watch nothing until :meth:`wake`."""
        with self._lock:
            self._idle = True

    def wake(self) -> None:
        """The loop runs again: the current step's clock starts now."""
        if self._idle:
            with self._lock:
                self._idle, self._last = False, self.clock()

    def overdue(self) -> Overdue | None:
        """What is hung, if the current step (or the save the loop waits for) has taken longer than its limit."""
        with self._lock:
            if self._paused or self._idle:
                return None
            saving_since, step = self._saving_since, self._step
        if saving_since is not None:
            limit = self.save_limit()
            waited = self.clock() - saving_since
            return Overdue(step, waited, limit, "save") if waited > limit else None
        limit = self.limit()
        with self._lock:
            if self._paused or self._idle or self._saving_since is not None:
                return None
            waited = self.clock() - self._last
            step = self._step
        return Overdue(step, waited, limit) if waited > limit else None

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, max(0.05, self.limit() / 10))):
            hung = self.overdue()
            if hung is not None:
                self.hung_on = hung.what
                self.on_hang(*hung)
                return

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Disarm it (the session's training is over: the final uploads are not watched)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None


class HangExit:
    """What a fired watchdog does: dump the stacks, let a committing save finish, record the end, then exit 76 (a
    script) or, given ``interrupt`` (an interactive kernel), raise :class:`~resumable.errors.Hung` in the training
    thread so that the cell ends and the kernel lives. ``interrupt(error)`` returns whether the thread took it."""

    def __init__(self, directory: Path, rank: int, session: int | None, configured: str,
                 end_session: Callable[[int, str, str], None] | None = None,
                 wait_save: Callable[[float], bool] | None = None,
                 exit: Callable[[int], None] = os._exit,  # noqa: A002 - the process exit to call
                 interrupt: Callable[[BaseException], bool] | None = None) -> None:
        self.path = Path(directory) / f"hang-{session if session is not None else f'pid{os.getpid()}'}-{rank}.txt"
        self.rank = rank
        self.configured = configured
        self.end_session = end_session
        self.wait_save = wait_save
        self.exit = exit
        self.interrupt = interrupt

    def describe(self, step: int, waited_s: float, limit_s: float, what: str) -> str:
        if what == "save":
            return (f"a checkpoint save did not finish for {format_duration(waited_s)} after step {step} (bound "
                    f"{format_duration(limit_s)}: --hang-timeout {self.configured} or {SAVE_FACTOR}x the slowest save "
                    f"so far, whichever is longer; a dead mount or disk?)")
        return (f"no optimizer step completed for {format_duration(waited_s)} after step {step} (hang timeout "
                f"{format_duration(limit_s)}, --hang-timeout {self.configured})")

    def __call__(self, step: int, waited_s: float, limit_s: float, what: str = "step") -> None:
        described = self.describe(step, waited_s, limit_s, what)
        try:
            write_stacks(self.path, f"resumable: {described}; rank {self.rank}, pid {os.getpid()}, "
                                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
            where = f"thread stacks in {self.path}"
        except OSError as e:
            where = f"the thread stacks could not be written to {self.path} ({e})"
        try:  # a save that is itself the hang is not waited for
            if what != "save" and self.wait_save is not None and not self.wait_save(SAVE_GRACE_S):
                log.warning(f"a checkpoint save was still running after {SAVE_GRACE_S:.0f}s; going on without it (an "
                            f"unfinished save has no manifest and is ignored)", all_ranks=True)
            if self.end_session is not None:
                self.end_session(step, "hang", f"{described}; {where}")
        except Exception as e:  # noqa: BLE001 - the exit matters more than the record
            log.warning(f"could not record the hang in sessions.jsonl ({e})", all_ranks=True)
        if self.interrupt is not None:
            log.error(f"{described}: training looks hung; {where}. Stopping it with an exception (the kernel and its "
                      f"variables stay): the newest committed checkpoint is intact, run the cell again to continue "
                      f"from it", all_ranks=True)
            if not self.interrupt(Hung(f"{described}; {where}")):
                log.error("the training thread did not respond: it is blocked inside code that cannot be interrupted "
                          "(a collective, a system call on a dead mount). Restart the kernel (Colab: Runtime > Restart "
                          "session) and run the cells again; the newest committed checkpoint is intact",
                          all_ranks=True)
            return
        log.error(f"{described}: the process looks hung; {where}. Exiting with code {EXIT_HANG} so that a supervisor "
                  f"restarts it: the newest committed checkpoint is intact", all_ranks=True)
        log.flush_outputs()
        self.exit(EXIT_HANG)


def start_watchdog(timeout: str | None, fixed_s: float | None, directory: Path, rank: int, session: int | None,
                   step: int, end_session: Callable[[int, str, str], None] | None,
                   wait_save: Callable[[float], bool] | None, slowest_save: Callable[[], float] = lambda: 0.0,
                   interrupt: Callable[[BaseException], bool] | None = None) -> Watchdog:
    """Arm the watchdog of a session whose training starts now, after ``step`` steps. ``interrupt``: raise in the
    training thread instead of exiting the process (an interactive kernel)."""
    hang = HangExit(directory, rank, session, timeout or "auto", end_session, wait_save, interrupt=interrupt)
    dog = Watchdog(fixed_s, hang, slowest_save=slowest_save)
    dog.start(step)
    return dog
