"""The processes of one chaos session: found by a marker in their environment, signalled, killed together."""

from __future__ import annotations

import os
import signal
from pathlib import Path

# A marker in each session's environment, inherited by everything it starts (DataLoader workers, torchrun's
# workers, which torchrun puts in sessions of their own): how chaos finds them all, orphans included, to
# SIGKILL them together and to wait for them before the next start. Never read by the engine.
SESSION_ENV = "RESUMABLE_CHAOS_SESSION"


def _session_pids(tag: str) -> list[int]:
    """Live processes of one session (its environment has ``SESSION_ENV=tag``); none where /proc is missing."""
    needle = f"{SESSION_ENV}={tag}".encode()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    pids = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # gone, or not ours to read
            continue
        if state not in ("Z", "X"):  # a zombie has exited; its parent (maybe init) reaps it
            pids.append(int(entry))
    return pids


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        _signal(pid, signal.SIGKILL)
