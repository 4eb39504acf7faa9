"""The faults `resumable chaos` injects (``--fault``): what each does to a session, how resumable notices it, and
whether the session ends with it.

External faults are signals chaos sends at a random moment; armed faults are handed to the session when it
starts (``RESUMABLE_FAULTS``, installed as its fault hook by chaos's child bootstrap) and fire from inside it,
timed from its first step: a hang of the training thread, a checkpoint write that fails with EIO.
"""

from __future__ import annotations

import random
import signal
from dataclasses import dataclass

from ..errors import EXIT_HANG, EXIT_NOT_DURABLE, EXIT_RESUME


@dataclass(frozen=True)
class FaultKind:
    name: str
    detected: str  # how resumable, or the next start, deals with it
    signal: signal.Signals | None = None  # sent from outside; None: armed inside the session
    ends_session: bool = True
    drive: bool = False  # injected into the session's Drive API traffic by chaos's fault proxy

    @property
    def armed(self) -> bool:
        return self.signal is None and not self.drive


KINDS = {kind.name: kind for kind in (
    FaultKind("kill", "nothing to detect: the next start resumes from the newest committed checkpoint",
              signal.SIGKILL),
    FaultKind("term", f"signal handler: a checkpoint at the next step boundary, exit {EXIT_RESUME}", signal.SIGTERM),
    FaultKind("int", f"signal handler (Ctrl-C): a checkpoint at the next step boundary, exit {EXIT_RESUME}",
              signal.SIGINT),
    FaultKind("stop-cont", "nothing to detect: SIGCONT continues the process where SIGSTOP froze it",
              signal.SIGSTOP, ends_session=False),
    FaultKind("segfault", "the process dies of SIGSEGV (its stacks on stderr); the next start resumes",
              signal.SIGSEGV),
    FaultKind("hang", f"step watchdog: no step for --hang-timeout, stacks dumped to the run dir, exit {EXIT_HANG}"),
    FaultKind("writer-error", "the save fails with EIO: a warning, the previous checkpoint stays the newest, the "
              "next trigger saves again", ends_session=False),
    FaultKind("drive", "the Drive client retries with backoff and jitter (a stall after its HTTP timeout, a drop "
              "after the reset); an upload goes on from the bytes Drive acknowledged; training never waits",
              ends_session=False, drive=True),
)}
SIGNAL_KINDS = ("kill", "term", "int")  # what --signal mix draws from
CHOICES = (*KINDS, "mix")
STOP_CONT_PAUSE_S = (0.5, 2.0)  # how long a SIGSTOP lasts (uniform), short of any sane --hang-timeout
SAVE_ERROR_MARK = "save_error_after_s)"  # in the OSError message of an injected save error (faults.py)


def pool(mode: str, drive: bool = False) -> tuple[str, ...]:
    """The kinds a mode draws from: one kind, ``mix`` (all; drive only with a Drive run dir, ``drive``), or
    ``signals`` (--signal mix)."""
    if mode == "mix":
        return tuple(n for n in KINDS if drive or not KINDS[n].drive)
    if mode == "signals":
        return SIGNAL_KINDS
    return (mode,)


def draw(mode: str, rng: random.Random, fresh: bool, drive: bool = False, deck: list[str] | None = None
         ) -> FaultKind:
    """The next fault of ``mode``. Armed faults are handed over when a session starts, so a session that goes on
    after a fault (stop-cont, writer-error, drive) gets only external ones afterwards (itself again for stop-cont
    and drive). ``deck``: the kinds not drawn yet, refilled in a shuffled order when empty, so a mix goes through
    every kind before one comes again; a fresh session takes the deck's armed kinds first, since only it can take
    them (left for last, one could wait behind a session that goes on and be skipped for a whole round)."""
    names = [n for n in pool(mode, drive) if fresh or not KINDS[n].armed]
    if not names:  # writer-error alone: the session runs on to its end
        raise LookupError(mode)
    if deck is None:
        return KINDS[rng.choice(names)]
    if not any(n in names for n in deck):  # a new round deals every kind, armed ones too
        every = [n for n in pool(mode, drive) if n not in deck]
        deck.extend(rng.sample(every, len(every)))
    eligible = [n for n in deck if n in names]
    name = next((n for n in eligible if KINDS[n].armed), eligible[0])
    deck.remove(name)
    return KINDS[name]


def exit_codes(kind: FaultKind) -> tuple[int, ...]:
    """The exit codes a session ended by ``kind`` may have (130: a second SIGINT during the final save)."""
    if kind.name == "hang":
        return (EXIT_HANG,)
    if kind.signal in (signal.SIGTERM, signal.SIGINT):  # 74: stopped, but its newest checkpoint missed Drive
        return (EXIT_RESUME, EXIT_NOT_DURABLE, -kind.signal, 130, 1)
    return (-signal.SIGKILL, -kind.signal) if kind.signal is not None else ()


def killed_workers(kind: FaultKind | None, code: int, stderr: str) -> bool:
    """A launcher (torchrun, as a command target) whose workers ``kind`` killed from inside (SIGKILL at the first step
    after a resume): the launcher itself exits 1 and says which signal its workers got."""
    return (kind is not None and kind.signal == signal.SIGKILL and code == 1
            and "Signal 9 (SIGKILL) received" in stderr)
