"""Where this process runs, as far as it changes what a session may do: Google Colab (its VM lifetime and the
default session budget that follows from it). Nothing here imports torch or the engine."""

from __future__ import annotations

import math
import os
import sys
import time

from .config import parse_duration
from .errors import ResumableError

# Colab tells the VM neither its lifetime nor the user's plan: no COLAB_* variable, file or metadata entry holds
# either. Its FAQ gives "as much as 12 hours" for free VMs and up to 24 h on paid plans (never guaranteed), so
# 12 h is the default (on a paid plan a session then stops early and the next one continues), and
# RESUMABLE_COLAB_VM_LIFETIME=24h says otherwise.
COLAB_VM_LIFETIME_S = 12 * 3600.0
COLAB_LIFETIME_ENV = "RESUMABLE_COLAB_VM_LIFETIME"
COLAB_SAFETY_S = 20 * 60.0
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


def vm_uptime_s() -> float | None:
    try:
        with open("/proc/uptime", encoding="ascii") as handle:
            return float(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def colab_vm_lifetime_s() -> tuple[float, str]:
    """``(seconds, where from)``: the Colab VM's maximum lifetime, from RESUMABLE_COLAB_VM_LIFETIME (a duration such
    as ``24h`` or ``23h30m``; a bare number is hours) or the 12 h default (see :data:`COLAB_VM_LIFETIME_S`)."""
    text = os.environ.get(COLAB_LIFETIME_ENV, "").strip()
    if not text:
        return COLAB_VM_LIFETIME_S, "Colab's 12h default"
    try:
        try:
            seconds = float(text) * 3600.0  # "24": hours (a lifetime of 24 seconds means nothing)
        except ValueError:
            seconds = parse_duration(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ResumableError(f"{COLAB_LIFETIME_ENV}={text!r} is not a VM lifetime; write e.g. 24h (Colab Pro) or "
                             f"12h (free), or unset it for the 12h default")
    return seconds, f"{COLAB_LIFETIME_ENV}={text}"


def colab_default_limit_s() -> float | None:
    """Seconds left before the Colab VM's lifetime (:func:`colab_vm_lifetime_s`) ends, less a safety margin,
    counted from VM boot (a notebook may have run for hours before this process started). None outside Colab.

    0 when less than the margin is left: no step may start, so the session commits a checkpoint at once and stops
    (exit 75) while the VM still lives. (A floor above 0 would train on into the margin kept for that save.)"""
    if not in_colab():
        return None
    uptime = vm_uptime_s()
    if uptime is None:
        return None
    lifetime, _ = colab_vm_lifetime_s()
    return max(lifetime - COLAB_SAFETY_S - uptime, 0.0)
