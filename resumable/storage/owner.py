"""Who holds a run dir: the owner record that the kernel lock (engine/rundir/lock.py) and the Drive lease
(storage/lease.py) both write, parsed and validated, and when an owner is stale.

Every record is parsed into a :class:`LockRecord` (types and ranges checked); a missing-field, wrong-typed,
half-written, non-UTF-8 or non-regular one is :class:`Unreadable`. "Another host" is judged by :func:`machine_id`
(machine id, boot id, pid namespace), not by the hostname alone: containers and cloned VM images share hostnames,
and a pid is only meaningful where it was handed out.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PID_LIMIT = 1 << 22  # Linux's PID_MAX_LIMIT: no supported system hands out a larger pid
_MAX_RECORD_BYTES = 64 * 1024  # a record is ~250 bytes; anything far larger is not one (and is not read whole)
_MAX_TEXT = 256
_NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)  # a record is read only if it is a regular file


@dataclass(frozen=True)
class LockRecord:
    """A parsed, validated lock (or Drive lease) record."""

    pid: int
    host: str
    heartbeat: float
    token: str = ""  # written by every owner; records of older versions may lack it
    started: str = ""
    pid_start: str | None = None  # /proc start time of pid, so a recycled pid is not taken for the owner
    released: bool = False
    machine: str = ""  # machine_id() of the owner: its pid can be judged only where this matches (older: absent)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Unreadable:
    """A record that exists but cannot be trusted; ``reason`` says why (for messages)."""

    reason: str


Owner = LockRecord | Unreadable


def _show(value: object) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int too long to print
        return "a huge number"
    return text if len(text) <= 40 else f"{text[:37]}..."


def _text(data: dict[str, Any], name: str, default: str | None) -> str | None:
    value = data.get(name, default)
    if value is default or (isinstance(value, str) and len(value) <= _MAX_TEXT):
        return value
    raise ValueError(f"{name} {_show(value)} is not a short text")


def parse_record(data: object) -> Owner:
    """``data`` (decoded JSON) as a :class:`LockRecord`, or :class:`Unreadable` saying what is wrong."""
    if not isinstance(data, dict):
        return Unreadable(f"it holds {type(data).__name__}, not a record")
    pid, host, heartbeat = data.get("pid"), data.get("host"), data.get("heartbeat")
    released = data.get("released", False)
    try:
        if type(pid) is not int or not 0 < pid < PID_LIMIT:  # type(): True is an int, and not a pid
            raise ValueError(f"pid {_show(pid)} is not a process id (1..{PID_LIMIT - 1})")
        if not isinstance(host, str) or not host or len(host) > _MAX_TEXT:
            raise ValueError(f"host {_show(host)} is not a host name")
        if type(heartbeat) not in (int, float) or not math.isfinite(heartbeat) or heartbeat < 0:
            raise ValueError(f"heartbeat {_show(heartbeat)} is not a time")
        if type(released) is not bool:
            raise ValueError(f"released {_show(released)} is not true or false")
        token, started, pid_start = _text(data, "token", ""), _text(data, "started", ""), _text(data, "pid_start", None)
        machine = _text(data, "machine", "")
    except ValueError as e:
        return Unreadable(str(e))
    return LockRecord(pid, host, float(heartbeat), token or "", started or "", pid_start, released, machine or "")


def parse_record_bytes(raw: bytes) -> Owner:
    if not raw.strip():
        return Unreadable("it is empty: a start that had not finished writing it, or a crash")
    if len(raw) > _MAX_RECORD_BYTES:
        return Unreadable("it is far larger than a lock record")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return Unreadable("it is not UTF-8 text")
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        return Unreadable("it is not valid JSON: half-written or damaged")
    return parse_record(data)


def read_record_file(path: Path) -> Owner | None:
    """The record in ``path``; None when there is none. Opens only a regular file, never follows a symlink and
    never blocks (a FIFO planted there would hang ``open``), and reads a bounded amount."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return Unreadable("it is not a regular file (a symlink, folder or device), so it was not opened")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except FileNotFoundError:
        return None  # released (or never written)
    except OSError as e:
        return Unreadable(f"it cannot be opened: {e.strerror or e}")
    with os.fdopen(fd, "rb") as handle:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for something else after the lstat
                return Unreadable("it is not a regular file, so it was not read")
            return parse_record_bytes(handle.read(_MAX_RECORD_BYTES + 1))
        except OSError as e:
            return Unreadable(f"it cannot be read: {e.strerror or e}")


def _proc_start(pid: int) -> str | None:  # Linux: so a recycled pid is not mistaken for the owner
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        pass
    return True


def _first_line(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.readline().strip()
    except OSError:
        return ""


def machine_id() -> str:
    """This machine as a lock or lease record names it. A hostname is not enough: containers and VMs cloned from one
    image share it, and a pid is only meaningful where it was handed out. So: the machine id (cloned images may share
    it too), the boot id (one per kernel boot) and the pid namespace (two containers on one kernel have their own)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    parts = [_first_line("/etc/machine-id") or _first_line("/var/lib/dbus/machine-id"),
             _first_line("/proc/sys/kernel/random/boot_id"), namespace]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16] if any(parts) else ""


MACHINE = machine_id()


def same_machine(owner: LockRecord, host: str, machine: str = MACHINE) -> bool:
    """Whether ``owner`` runs where this process does, so that its pid can be checked here. A record of an older
    resumable (no machine id) is judged by its hostname, as it was written to be."""
    if owner.host != host:
        return False
    return not owner.machine or not machine or owner.machine == machine


def stale_reason(owner: Owner, host: str, stale_after_s: float, now: float | None = None,
                 machine: str = MACHINE) -> str | None:
    """Why ``owner`` no longer holds its lock or lease, judged from the record alone; None if it may."""
    if isinstance(owner, Unreadable):
        return f"its record is unreadable ({owner.reason})"
    if owner.released:
        return "it was released"
    if same_machine(owner, host, machine):
        if not _pid_alive(owner.pid):
            return f"process {owner.pid} on this host is gone"
        if owner.pid_start and _proc_start(owner.pid) not in (None, owner.pid_start):
            return f"process {owner.pid} on this host is gone (its pid now belongs to another process)"
        return None
    age = (time.time() if now is None else now) - owner.heartbeat
    if age > stale_after_s:
        return f"its heartbeat is {age:.0f}s old"
    if age < -stale_after_s:  # a heartbeat that could never age would hold the run dir for ever
        return f"its heartbeat is {-age:.0f}s in the future (a damaged record, or that host's clock is far off)"
    return None


def lock_record(token: str, host: str) -> LockRecord:
    return LockRecord(pid=os.getpid(), host=host, heartbeat=time.time(), token=token,
                      started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), pid_start=_proc_start(os.getpid()),
                      machine=MACHINE)


def in_use_message(where: str, owner: Owner | None) -> str:
    advice = "wait for it to finish or stop it, or use another --run-dir"
    if isinstance(owner, LockRecord) and not owner.released:
        return (f"{where} is being trained by process {owner.pid} on host {owner.host} (started "
                f"{owner.started or 'at an unknown time'}); {advice}")
    return f"{where} is being trained by another process (its record is not readable yet); {advice}"


