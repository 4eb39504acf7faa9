"""The open runs of this process, by run dir, and how a loop that was left is told what ended it.

A re-run notebook cell closes the previous Run on its run dir. A ``for ... in run:`` loop left by ``break`` or by an
exception drops its iterator, and CPython finalises the generator at once: the session ends there (watchdog
disarmed, run dir released) as "break", because a generator cannot see the exception that is unwinding past it.
What ended it is learned right after: ``sys.excepthook`` (a script), IPython's ``post_run_cell`` (a notebook cell)
or ``with run:`` pass the exception to :func:`loop_ended`, and each Run left by it amends its session's end record
(``error: ValueError`` at step N). ``atexit`` closes whatever is still open while the interpreter is whole, not at
teardown, where a finalised generator cannot even open sessions.jsonl.
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from types import FrameType
from typing import Any

from . import notebook

_OPEN: dict[str, Any] = {}  # run dir key -> Run
_LEFT: weakref.WeakSet = weakref.WeakSet()  # Runs whose loop was left; their end may still be amended
_HOOKED: list[Any] = []  # the IPython shell whose post_run_cell event calls :func:`_after_cell`
_STUCK: dict[str, Any] = {}  # run dir key -> the writer of a save given up as stuck (its thread may still run)
STUCK_WAIT_S = 10.0  # how long a new Run waits for such a save's thread to end before refusing


def key(run_dir: str) -> str:
    """One key per run dir however it is spelled (``runs/x``, ``./runs/x``, an absolute path); URLs as they are."""
    return run_dir if "://" in run_dir else os.path.abspath(os.path.expanduser(run_dir))


def get(run_dir: str) -> Any:
    return _OPEN.get(key(run_dir))


def add(run_dir: str, run: Any) -> None:
    _OPEN[key(run_dir)] = run
    _hook_shell()


def remove(run_dir: str, run: Any) -> None:
    if _OPEN.get(key(run_dir)) is run:
        del _OPEN[key(run_dir)]


def stuck(run_dir: str, writer: Any) -> None:
    """``writer``'s save on ``run_dir`` was given up as stuck: a new Run there waits for its thread first."""
    _STUCK[key(run_dir)] = writer


def wait_for_stuck_save(run_dir: str, wait_s: float = STUCK_WAIT_S) -> None:
    """Before a new session on ``run_dir``: a save given up as stuck by an earlier Run of this process may still be
    writing into the same step dirs. Wait for its thread to end; refuse, naming the fix, if it does not."""
    from ...errors import ResumableError

    writer = _STUCK.get(key(run_dir))
    if writer is None:
        return
    thread = writer.abandoned_thread
    if thread is not None:
        thread.join(wait_s)
    if thread is None or not thread.is_alive():
        _STUCK.pop(key(run_dir), None)
        return
    raise ResumableError(f"a checkpoint save of an earlier Run on {run_dir} in this process is still stuck (a dead "
                         f"mount or disk?) and cannot be stopped from Python. Restart the kernel (Colab: Runtime > "
                         f"Restart session), then run the cells again: the newest committed checkpoint is intact")


def left(run: Any) -> None:
    """``run``'s loop was left (break or an exception): the next report of an exception may amend its end."""
    _LEFT.add(run)


def loop_ended(error: BaseException | None) -> None:
    """An exception reached the top (a script), ended a cell (a notebook) or left a ``with run:`` block: every Run
    whose loop it unwound records it as how its session ended; the others are unaffected."""
    for run in list(_LEFT):
        if error is None or run.amend_end(error):
            _LEFT.discard(run)


def close_all(error: BaseException | None) -> None:
    """End every open Run of this process, recording ``error`` as how its session ended."""
    for run in list(_OPEN.values()):
        try:
            run.close(error)
        except Exception:  # noqa: BLE001 - best effort: the exception being reported matters more
            pass
    loop_ended(error)


def loop_position() -> tuple[int, int] | None:
    """(frame id, instruction) of the frame whose ``for`` loop dropped the Run's iterator, seen from inside the
    generator that this finalises: the first frame outside resumable and outside generators wrapping the Run
    (``tqdm(run)``). An exception that unwound that loop has a traceback entry at exactly this place."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (frame.f_globals.get("__name__", "").split(".")[0] == "resumable"
                                 or frame.f_code.co_flags & _GENERATOR):
        frame = frame.f_back
    return (id(frame), frame.f_lasti) if frame is not None else None


_GENERATOR = 0x20  # inspect.CO_GENERATOR


def unwound(error: BaseException, position: tuple[int, int]) -> bool:
    """Whether ``error``'s traceback passes the frame at ``position`` (see :func:`loop_position`)."""
    tb = error.__traceback__
    while tb is not None:
        if (id(tb.tb_frame), tb.tb_lasti) == position:
            return True
        tb = tb.tb_next
    return False


def _after_cell(result: Any = None) -> None:
    """IPython's ``post_run_cell``: the cell is over, so no loop of it is running. A Run whose loop the cell's error
    unwound records it; an open Run whose loop is suspended (an iterator kept in a variable) stops being watched for
    hangs until its next step."""
    error = getattr(result, "error_in_exec", None)
    for run in list(_OPEN.values()):
        try:
            run.cell_ended(error)
        except Exception:  # noqa: BLE001 - never break the user's shell
            pass
    try:
        if isinstance(error, BaseException):
            loop_ended(error)
    except Exception:  # noqa: BLE001
        pass
    _LEFT.clear()  # the next cell's exceptions are its own


def _hook_shell() -> None:
    shell = notebook.shell()
    if shell is None or any(hooked is shell for hooked in _HOOKED):
        return
    try:
        shell.events.register("post_run_cell", _after_cell)
    except Exception:  # noqa: BLE001 - an IPython without events: the loop's own finalisation still ends it
        return
    _HOOKED.append(shell)


def _install_exit_hooks() -> None:
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        close_all(error)
        previous(kind, error, tb)

    sys.excepthook = hook
    atexit.register(close_all, None)


_install_exit_hooks()
