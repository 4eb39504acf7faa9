"""The open runs of this process, by run dir: a re-run notebook cell closes the previous Run on its run dir,
and an exception that leaves a ``for ... in run:`` loop (which never reaches the generator) ends its session
while the interpreter is whole (``sys.excepthook``; ``atexit`` for anything else), not at teardown, where a
finalised generator cannot even open sessions.jsonl."""

from __future__ import annotations

import atexit
import sys
from typing import Any

_OPEN: dict[str, Any] = {}  # run dir -> Run


def get(run_dir: str) -> Any:
    return _OPEN.get(run_dir)


def add(run_dir: str, run: Any) -> None:
    _OPEN[run_dir] = run


def remove(run_dir: str, run: Any) -> None:
    if _OPEN.get(run_dir) is run:
        del _OPEN[run_dir]


def close_all(error: BaseException | None) -> None:
    """End every open Run of this process, recording ``error`` as how its session ended."""
    for run in list(_OPEN.values()):
        try:
            run.close(error)
        except Exception:  # noqa: BLE001 - best effort: the exception being reported matters more
            pass


def _install_exit_hooks() -> None:
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        close_all(error)
        previous(kind, error, tb)

    sys.excepthook = hook
    atexit.register(close_all, None)


_install_exit_hooks()
