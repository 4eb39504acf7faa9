"""All of resumable's output goes through one logger, ``logging.getLogger("resumable")``.

Messages print as ``resumable: ...`` on standard error (``resumable: warning: ...`` from WARNING up), through
``tqdm.write`` so they never tear a progress bar. :data:`SUMMARY` lines (how a session ended) sit between INFO and
WARNING, so that quiet mode (``--quiet``, ``Reporting(quiet=True)``) keeps them with the warnings and errors. Under DDP
only rank 0 prints, unless a message is marked ``extra={"all_ranks": True}``. Output must never stop training or a
save: a closed pipe (``| head``), a terminal that went away or a vanished notebook output makes the handler drop the
message, silently.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from tqdm import tqdm

LOGGER_NAME = "resumable"
logger = logging.getLogger(LOGGER_NAME)
SUMMARY = 25  # the final summary of a session: shown in quiet mode
logging.addLevelName(SUMMARY, "SUMMARY")


class _RankFilter(logging.Filter):
    rank = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or bool(getattr(record, "all_ranks", False))


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        rank = getattr(record, "rank_label", "")
        if record.levelno >= logging.ERROR:
            return f"resumable{rank}: error: {message}"
        if record.levelno >= logging.WARNING:
            return f"resumable{rank}: warning: {message}"
        return f"resumable{rank}: {message}"


class SafeStderrHandler(logging.Handler):
    """Writes to the *current* ``sys.stderr`` (so redirections and test capture work) and swallows every
    output error: losing a message is better than losing the run."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - EPIPE, EIO, a closed or replaced stream: never raise from output
            pass

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass


_filter = _RankFilter()


def _install() -> None:
    if any(isinstance(h, SafeStderrHandler) for h in logger.handlers):
        return
    handler = SafeStderrHandler()
    handler.setFormatter(_Formatter())
    handler.addFilter(_filter)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # our own handler prints; a user's root handler would print it twice


def set_rank(rank: int) -> None:
    """Under DDP: only rank 0 prints (messages with ``all_ranks`` excepted)."""
    _filter.rank = rank


def info(message: str, *, all_ranks: bool = False) -> None:
    logger.info(message, extra={"all_ranks": all_ranks})


def warning(message: str, *, all_ranks: bool = False) -> None:
    logger.warning(message, extra={"all_ranks": all_ranks})


def error(message: str, *, all_ranks: bool = False) -> None:
    logger.error(message, extra={"all_ranks": all_ranks})


def summary(message: str) -> None:
    """A line of the final summary (kept in quiet mode)."""
    logger.log(SUMMARY, message)


def set_quiet(on: bool) -> None:
    """Quiet mode for the whole process (``resumable-train --quiet``): warnings, errors and the summary only."""
    logger.setLevel(SUMMARY if on else logging.INFO)


@contextlib.contextmanager
def quiet(on: bool) -> Iterator[None]:
    """Quiet mode while the block runs (one Run's session), the previous level after."""
    if not on:
        yield
        return
    before = logger.level
    logger.setLevel(max(before, SUMMARY))
    try:
        yield
    finally:
        logger.setLevel(before)


_install()


def flush_outputs() -> None:
    """Flush stdout and stderr before the process ends at once (``os._exit`` skips Python's own flush); a reader
    that is gone (a closed pipe) changes nothing."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
