"""One writer per run dir: a lock file naming its owner, with a heartbeat.

Two notebooks training into one run dir would interleave checkpoints and metrics. The lock file
``RUN_DIR/lock.json`` records pid, host, start time and a heartbeat refreshed by a background thread.
A lock is stale, and is taken over with a message, when its pid is gone on this host, or when its
heartbeat is older than ``stale_after_s`` (another host that died without a signal).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ..errors import RunDirInUse

LOCK_FILE = "lock.json"


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux), so a recycled pid is not mistaken for the owner."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def stale_reason(owner: dict[str, Any], host: str, stale_after_s: float) -> str | None:
    """Why ``owner`` (a lock record) no longer holds its lock, or None if it does."""
    if owner.get("released"):
        return "it was released"
    if not owner.get("pid") or not owner.get("host"):
        return "the lock file is unreadable"
    if owner["host"] == host:
        pid = int(owner["pid"])
        if not _pid_alive(pid):
            return f"process {pid} on this host is gone"
        if owner.get("pid_start") and _proc_start(pid) not in (None, owner["pid_start"]):
            return f"process {pid} on this host is gone (its pid now belongs to another process)"
        return None
    age = time.time() - float(owner.get("heartbeat", 0))
    if age > stale_after_s:
        return f"its heartbeat is {age:.0f}s old"
    return None


def lock_record(token: str, host: str) -> dict[str, Any]:
    return {"pid": os.getpid(), "pid_start": _proc_start(os.getpid()), "host": host, "token": token,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "heartbeat": time.time()}


def in_use_message(where: str, owner: dict[str, Any]) -> str:
    return (f"{where} is being trained by process {owner.get('pid')} on host {owner.get('host')} (started "
            f"{owner.get('started')}); wait for it to finish or stop it, or use another --run-dir")


class RunLock:
    def __init__(self, run_dir: Path, heartbeat_s: float = 30.0, stale_after_s: float = 180.0) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.token = uuid.uuid4().hex
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None  # set when another process took the lock over: stop, write nothing more

    def _record(self) -> dict[str, Any]:
        return lock_record(self.token, self.host)

    def _read(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # torn or garbage: treated as stale below
        return data if isinstance(data, dict) else {}

    def stale_reason(self, owner: dict[str, Any]) -> str | None:
        return stale_reason(owner, self.host, self.stale_after_s)

    def acquire(self) -> str | None:
        """Take the lock; returns a message if a stale lock was taken over. Raises RunDirInUse."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = self._read()
                if owner is None:
                    continue  # released meanwhile
                reason = self.stale_reason(owner)
                if reason is None:
                    raise RunDirInUse(in_use_message(str(self.path.parent), owner)) from None
                tmp = self.path.with_name(f".{LOCK_FILE}.{self.token}")
                tmp.write_text(json.dumps(self._record()), encoding="utf-8")
                os.replace(tmp, self.path)
                if (self._read() or {}).get("token") == self.token:
                    self._start_heartbeat()
                    return (f"took over the lock of {self.path.parent} from process {owner.get('pid')} on "
                            f"{owner.get('host')}: {reason}")
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(self._record(), handle)
            self._start_heartbeat()
            return None
        raise RunDirInUse(f"could not take the lock {self.path}: another process keeps taking it")

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="resumable-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            owner = self._read() or {}
            if owner.get("token") != self.token:  # taken over: never write someone else's lock
                self.lost = (f"the lock of {self.path.parent} was taken over by process {owner.get('pid')} on "
                             f"{owner.get('host')}")
                return
            record = {**owner, "heartbeat": time.time()}
            tmp = self.path.with_name(f".{LOCK_FILE}.{self.token}")
            tmp.write_text(json.dumps(record), encoding="utf-8")
            os.replace(tmp, self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if (self._read() or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
