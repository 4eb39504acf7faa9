"""Crash-loop detection: a start that would fail the way the last ones did stops before training (exit 77).

A supervisor (a restart loop, torchrun's restarts, a scheduled Colab re-run) restarts a failed run at once. When
the failure is in the run itself (a step that always raises, an out-of-memory kill, a hang at the same place), every
restart resumes from the same checkpoint and fails again, forever. ``sessions.jsonl`` says so: when the last
:data:`SESSIONS` sessions all started from the step this start would resume from and each ended in a failure --
killed without an end record, an exception (``error: ...``), a hang, a save error -- none of them committed a
checkpoint past it (one that had would be resumed instead). Stops on purpose (a signal, the time limit, Ctrl-C) are
not failures. ``--ignore-crash-loop`` starts anyway; ``--resume-from STEP`` goes back to an older checkpoint
(engine/rewind.py), which starts a new count.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import CrashLoop
from ..reporting.history import SessionRecord

SESSIONS = 3  # failed sessions from one step in a row that make a crash loop


def failed(session: SessionRecord) -> bool:
    """Whether the session ended in a failure (not finished, and not stopped on purpose)."""
    ended = session.ended
    return ended is None or ended in ("hang", "save error") or ended.startswith("error")


def crash_loop(sessions: Sequence[SessionRecord], step: int) -> list[SessionRecord] | None:
    """The last sessions when they make a crash loop at ``step`` (the step this start would resume from)."""
    last = list(sessions[-SESSIONS:])
    if len(last) == SESSIONS and all(s.start_step == step and failed(s) for s in last):
        return last
    return None


def _how(session: SessionRecord) -> str:
    if session.ended is None:
        return "killed without an end record (out of memory? SIGKILL? the VM went away?)"
    return session.error or session.ended


def check_crash_loop(sessions: Sequence[SessionRecord], step: int, older: Sequence[int], run_dir: str) -> None:
    """Raise :class:`CrashLoop` (exit 77) when the last sessions make a crash loop at ``step``; ``older``: the
    valid checkpoint steps before it, to go back to."""
    loop = crash_loop(sessions, step)
    if loop is None:
        return
    ends = "; ".join(f"session {s.session}: {s.ended or 'killed'}" for s in loop)
    back = (f"resume from an older checkpoint with --resume-from STEP (resume_from=STEP in Run; steps available: "
            f"{', '.join(map(str, older))})" if older else "there is no older checkpoint to go back to")
    raise CrashLoop(f"crash loop in {run_dir}: the last {SESSIONS} sessions all started from step {step} and failed "
                    f"without committing a checkpoint past it ({ends}). Last error: {_how(loop[-1])}. Starting again "
                    f"would most likely fail the same way: fix the cause, or {back}, or start anyway with "
                    f"--ignore-crash-loop (ignore_crash_loop=True in Run). Nothing was changed")
