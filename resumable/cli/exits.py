"""How a command ends: its last message and its exit code, also when stderr's reader is gone."""

from __future__ import annotations

import os
import sys

import click


def fail(message: str) -> None:
    """Bad input: say what is wrong and exit 2 (nothing was started or changed)."""
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


def echo_err(message: str) -> None:
    """A last message on stderr; its reader may be gone (a closed pipe, `| head`), which must not change the
    exit code."""
    try:
        click.echo(message, err=True)
    except OSError:
        pass


def exit_with(code: int) -> None:
    """Exit with ``code`` even when stderr's reader is gone: Python would otherwise fail flushing it at shutdown
    and exit 120 with a BrokenPipeError. Fast when nothing is left running (see :func:`exit_now`)."""
    try:
        sys.stderr.flush()
    except OSError:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
        except (OSError, ValueError):
            pass
    sys.exit(code)


def exit_now(code: int) -> None:
    """End the process at once when the work is over: the exit handlers run (``atexit``: the Run's own, W&B's,
    logging's), then the interpreter's teardown is skipped. Tearing down torch's modules and static objects took
    ~0.9 s of every resumable-train process (the run was complete, every file closed and fsynced). Not taken while
    another thread or a child process is alive: then Python's own exit joins them as usual."""
    import atexit
    import multiprocessing
    import threading

    from .. import log

    if any(t is not threading.main_thread() and t.is_alive() and not t.daemon for t in threading.enumerate()):
        return
    if multiprocessing.active_children():
        return
    atexit._run_exitfuncs()
    log.flush_outputs()
    os._exit(code)
