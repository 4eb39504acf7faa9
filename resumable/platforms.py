"""Where this process runs, as far as it changes what a session may do: Google Colab and Kaggle (how long their
sessions live, the default session budget that follows, and on Kaggle the one folder a saved version keeps).
Nothing here imports torch or the engine."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .config import parse_duration
from .errors import ResumableError

# Colab tells the VM neither its lifetime nor the user's plan: no COLAB_* variable, file or metadata entry holds
# either. Its FAQ gives "as much as 12 hours" for free VMs and up to 24 h on paid plans (never guaranteed), so
# 12 h is the default (on a paid plan a session then stops early and the next one continues), and
# RESUMABLE_COLAB_VM_LIFETIME=24h says otherwise.
COLAB_VM_LIFETIME_S = 12 * 3600.0
COLAB_LIFETIME_ENV = "RESUMABLE_COLAB_VM_LIFETIME"
COLAB_SAFETY_S = 20 * 60.0  # the margin kept before a hosted session's end (Colab's and Kaggle's)
# Kaggle ends a notebook session (interactive, or a saved version run as "Batch") after 12 h of GPU or CPU time (9 h
# on a TPU); it sets KAGGLE_KERNEL_RUN_TYPE in the kernel. A saved version keeps only /kaggle/working: anything else
# is gone with the session, checkpoints included.
KAGGLE_SESSION_S = 12 * 3600.0
KAGGLE_LIFETIME_ENV = "RESUMABLE_KAGGLE_SESSION_LIMIT"
KAGGLE_WORKING = Path("/kaggle/working")
# A Unix time (seconds since the epoch) at which a session's budget ends at the latest, whatever its own time limit:
# `resumable run --time-limit` gives each script it (re)starts what is left of the supervised session this way.
DEADLINE_ENV = "RESUMABLE_DEADLINE"


def deadline_left_s(now: float | None = None) -> float | None:
    """Seconds from ``now`` (``time.time()``) until ``$RESUMABLE_DEADLINE`` (0 once it has passed); None when unset.
    ResumableError (exit 2) for a value that is not a positive finite number, naming the fix."""
    text = os.environ.get(DEADLINE_ENV, "").strip()
    if not text:
        return None
    try:
        deadline = float(text)
    except ValueError:
        deadline = math.nan
    if not (math.isfinite(deadline) and deadline > 0):
        raise ResumableError(f"{DEADLINE_ENV}={text!r} is not a Unix time in seconds (what `resumable run "
                             f"--time-limit` sets, e.g. {time.time() + 3600:.0f} for an hour from now); unset it for "
                             f"no deadline")
    return max(deadline - (time.time() if now is None else now), 0.0)


def in_colab() -> bool:
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def in_kaggle() -> bool:
    """A Kaggle notebook's kernel (interactive, or a saved version's run: ``KAGGLE_KERNEL_RUN_TYPE=Batch``)."""
    return bool(os.environ.get("KAGGLE_KERNEL_RUN_TYPE", "").strip())


def kaggle_saved_version() -> bool:
    """A saved version ("Save & Run All") runs the notebook as a batch job: nobody can re-run a cell there."""
    return os.environ.get("KAGGLE_KERNEL_RUN_TYPE", "").strip().lower() == "batch"


def outside_kaggle_working(path: str | os.PathLike[str]) -> bool:
    """On Kaggle, whether ``path`` (a local run dir) is outside :data:`KAGGLE_WORKING`, the only folder a saved
    version keeps. False elsewhere, and for a Drive URL."""
    if not in_kaggle() or str(path).startswith("gdrive://"):
        return False
    resolved, working = Path(path).expanduser().resolve(), KAGGLE_WORKING.resolve()
    return resolved != working and working not in resolved.parents


def container_age_s() -> float | None:
    """Seconds since this container (its process 1) started: when a Kaggle session began, whatever the host's
    uptime. None where /proc does not say."""
    uptime = vm_uptime_s()
    try:
        with open("/proc/1/stat", encoding="ascii") as handle:
            started_ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    if uptime is None:
        return None
    return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def vm_uptime_s() -> float | None:
    try:
        with open("/proc/uptime", encoding="ascii") as handle:
            return float(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _lifetime(env: str, default_s: float, default_words: str, example: str) -> tuple[float, str]:
    """``(seconds, where from)``: ``$env`` (a duration such as ``24h`` or ``23h30m``; a bare number is hours), else
    ``default_s``. ResumableError naming the variable and ``example`` for anything else."""
    text = os.environ.get(env, "").strip()
    if not text:
        return default_s, default_words
    try:
        try:
            seconds = float(text) * 3600.0  # "24": hours (a lifetime of 24 seconds means nothing)
        except ValueError:
            seconds = parse_duration(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ResumableError(f"{env}={text!r} is not a session lifetime; write e.g. {example}, or unset it for the "
                             f"{format_hours(default_s)} default")
    return seconds, f"{env}={text}"


def format_hours(seconds: float) -> str:
    return f"{seconds / 3600:g}h"


def colab_vm_lifetime_s() -> tuple[float, str]:
    """``(seconds, where from)``: the Colab VM's maximum lifetime, from RESUMABLE_COLAB_VM_LIFETIME (a duration such
    as ``24h`` or ``23h30m``; a bare number is hours) or the 12 h default (see :data:`COLAB_VM_LIFETIME_S`)."""
    return _lifetime(COLAB_LIFETIME_ENV, COLAB_VM_LIFETIME_S, "Colab's 12h default", "24h (Colab Pro) or 12h (free)")


def kaggle_session_limit_s() -> tuple[float, str]:
    """``(seconds, where from)``: a Kaggle session's limit, from RESUMABLE_KAGGLE_SESSION_LIMIT (``9h`` on a TPU) or
    the 12 h default (see :data:`KAGGLE_SESSION_S`)."""
    return _lifetime(KAGGLE_LIFETIME_ENV, KAGGLE_SESSION_S, "Kaggle's 12h limit", "9h (a TPU session) or 12h")


@dataclass(frozen=True)
class Hosted:
    """A hosted notebook session that ends on its own: ``name``, how long it lives (``lifetime_s``, ``source`` of that
    figure), how long it has run (``age_s``, counted from ``counted_from``) and what is left less the margin
    (``left_s``: 0 when less than the margin is left)."""

    name: str
    lifetime_s: float
    source: str
    age_s: float
    counted_from: str
    lifetime_env: str

    @property
    def left_s(self) -> float:
        return max(self.lifetime_s - COLAB_SAFETY_S - self.age_s, 0.0)


def hosted() -> Hosted | None:
    """Colab or Kaggle, with their session's lifetime and age; None elsewhere (or where the age is not known)."""
    if in_colab():
        age = vm_uptime_s()
        lifetime, source = colab_vm_lifetime_s()
        where = ("Colab VM", "VM start", COLAB_LIFETIME_ENV)
    elif in_kaggle():
        age = container_age_s()
        lifetime, source = kaggle_session_limit_s()
        where = ("Kaggle session", "its container's start", KAGGLE_LIFETIME_ENV)
    else:
        return None
    if age is None:
        return None
    return Hosted(where[0], lifetime, source, age, where[1], where[2])


def colab_default_limit_s() -> float | None:
    """Seconds left before the Colab VM's lifetime (:func:`colab_vm_lifetime_s`) ends, less a safety margin,
    counted from VM boot (a notebook may have run for hours before this process started). None outside Colab.

    0 when less than the margin is left: no step may start, so the session commits a checkpoint at once and stops
    (exit 75) while the VM still lives. (A floor above 0 would train on into the margin kept for that save.)"""
    session = hosted() if in_colab() else None
    return session.left_s if session is not None else None
