"""Crash-loop detection: a start that would fail the way the last ones did stops before training (exit 77).

A supervisor (a restart loop, torchrun's restarts, a scheduled Colab re-run) restarts a failed run at once. When
the failure is in the run itself (a step that always raises, an out-of-memory kill, a hang at the same place), every
restart resumes from the same checkpoint and fails again, forever. ``sessions.jsonl`` says so: when the last
:data:`SESSIONS` sessions all started from the checkpoint this start would resume from, ran the same code and the
same config as this start (engine/session/identity.py), and each ended in a failure -- killed without an end record, an
exception (``error: ...``), a hang, a save error -- none of them committed a checkpoint past it (one that had would
be resumed instead). Stops on purpose (a signal, the time limit, Ctrl-C, ``break``) are not failures.

Never for a run with no committed checkpoint: starting over costs nothing, and that is where a script is debugged.
A changed script, notebook cell or option starts a new count. ``--ignore-crash-loop`` starts anyway;
``--resume-from STEP`` goes back to an older checkpoint (engine/rundir/rewind.py), which starts a new count.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import CrashLoop
from ...reporting.history import SessionRecord

SESSIONS = 3  # failed sessions from one step in a row that make a crash loop


def failed(session: SessionRecord) -> bool:
    """Whether the session ended in a failure (not finished, and not stopped on purpose)."""
    ended = session.ended
    return ended is None or ended in ("hang", "save error") or ended.startswith("error")


def crash_loop(sessions: Sequence[SessionRecord], step: int, code: str | None = None,
               config: str | None = None) -> list[SessionRecord] | None:
    """The last sessions when they make a crash loop at ``step`` (the step this start would resume from) with this
    ``code`` and ``config`` (None: not compared, for callers that do not know them)."""
    last = list(sessions[-SESSIONS:])
    same = lambda s: (code is None or s.code == code) and (config is None or s.config == config)  # noqa: E731
    if len(last) == SESSIONS and all(s.start_step == step and failed(s) and same(s) for s in last):
        return last
    return None


def _how(session: SessionRecord) -> str:
    if session.ended is None:
        return "killed without an end record (out of memory? SIGKILL? the VM went away?)"
    return session.error or session.ended


def check_crash_loop(sessions: Sequence[SessionRecord], step: int, older: Sequence[int], run_dir: str,
                     code: str | None = None, config: str | None = None) -> None:
    """Raise :class:`CrashLoop` (exit 77) when the last sessions make a crash loop at ``step``; ``older``: the
    valid checkpoint steps before it, to go back to."""
    loop = crash_loop(sessions, step, code, config)
    if loop is None:
        return
    ends = "; ".join(f"session {s.session}: {s.ended or 'killed'}" for s in loop)
    back = (f"resume from an older checkpoint with --resume-from STEP (Session(resume_from=STEP) in Run; steps "
            f"available: {', '.join(map(str, older))})" if older else "there is no older checkpoint to go back to")
    raise CrashLoop(f"crash loop in {run_dir}: the last {SESSIONS} sessions all started from step {step}, ran this "
                    f"same code and config, and failed without committing a checkpoint past it ({ends}). Last error: "
                    f"{_how(loop[-1])}. Starting again unchanged would most likely fail the same way. To continue: "
                    f"fix the cause and run again (a changed script, notebook cell or option starts a new count), or "
                    f"{back}, or start anyway with --ignore-crash-loop (Session(ignore_crash_loop=True) in Run). "
                    f"Nothing was changed")
