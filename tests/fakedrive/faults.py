"""Fault injection: the fault kinds, the armed ``Fault`` specs, and the canned replies of status/HTML faults.

Connection faults (drop, close, stall) have no reply of their own; the HTTP handler acts them out.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .replies import Reply, error_body, error_reply

# Status faults: name -> (HTTP status, error reason, message). Bodies mimic real Drive v2 JSON errors.
STATUS_FAULTS: dict[str, tuple[int, str, str]] = {
    "userRateLimitExceeded": (403, "userRateLimitExceeded", "User Rate Limit Exceeded"),
    "rateLimitExceeded": (403, "rateLimitExceeded", "Rate Limit Exceeded"),
    "storageQuotaExceeded": (403, "storageQuotaExceeded", "The user's Drive storage quota has been exceeded."),
    "429": (429, "rateLimitExceeded", "Too Many Requests"),
    "500": (500, "backendError", "Backend Error"),
    "503": (503, "backendError", "Service Unavailable"),
}
# Gateway errors from Google's front end come back as HTML, not JSON.
HTML_FAULTS: dict[str, int] = {"html502": 502, "html503": 503}
# drop: read half the body, then reset the connection (RST) -- what a dying proxy or NAT does.
# close: read the whole body, then close cleanly (FIN) without answering -- a stale keep-alive.
# stall: apply the request, then wait before answering, so a client with a shorter timeout gives up.
# lost: apply the request, then reset the connection: the answer is lost after the server acted.
CONNECTION_FAULTS = ("drop", "close", "stall", "lost")
FAULTS = (*STATUS_FAULTS, *HTML_FAULTS, *CONNECTION_FAULTS)


@dataclass
class Fault:
    kind: str
    remaining: int
    match: str | None = None
    skip: int = 0
    seconds: float = 0.0

    def matches(self, target: str) -> bool:
        return self.match is None or self.match in target


def fault_reply(kind: str) -> Reply | None:
    """The reply a status or HTML fault answers with instead of the real one; None for connection faults."""
    if kind in STATUS_FAULTS:
        reply = error_reply(*STATUS_FAULTS[kind])
        if kind in ("userRateLimitExceeded", "rateLimitExceeded"):
            reply = Reply(reply.status, error_body(*STATUS_FAULTS[kind], domain="usageLimits"), reply.headers)
        return reply
    if kind in HTML_FAULTS:
        status = HTML_FAULTS[kind]
        html = f"<!DOCTYPE html><html><head><title>Error {status}</title></head><body><p><b>{status}.</b> "
        html += "That's an error.</p><p>The server encountered a temporary error.</p></body></html>"
        return Reply(status, html.encode(), {"Content-Type": "text/html; charset=UTF-8"})
    return None


class FaultInjector:
    """The fault knobs of ``FakeDrive``: arm faults with ``inject``, and pick the one (if any) a request gets.

    Shares the drive's lock and request log (set up by ``FakeDrive``), so the request order and the fault
    bookkeeping change together.
    """

    lock: threading.RLock
    requests: list[tuple[str, str]]

    def __init__(self, stall_seconds: float) -> None:
        self.stall_seconds = stall_seconds
        self.faults_fired: list[tuple[str, str, str]] = []  # (fault, method, path?query)
        self._faults: list[Fault] = []
        self._cuts: list[int] = []  # armed cut_upload offsets, each fires once
        self.cut_keeps_partial = False

    def inject(
        self, fault: str | int, count: int = 1, match: str | None = None, *, skip: int = 0, seconds: float | None = None
    ) -> Fault:
        """Make the next ``count`` requests whose "METHOD /path?query" contains ``match`` fail with ``fault``.

        skip: let that many matching requests through first (e.g. fail the 3rd upload chunk).
        seconds: stall duration (default ``stall_seconds``).
        """
        kind = str(fault)
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; choose from {FAULTS}")
        spec = Fault(kind, count, match, skip, self.stall_seconds if seconds is None else seconds)
        with self.lock:
            self._faults.append(spec)
        return spec

    def cut_upload(self, at_bytes: int, *, keep_partial: bool = False) -> None:
        """Reset the connection of the first upload-session PUT during which that session's received bytes
        reach ``at_bytes`` (a VM or proxy dying mid-chunk). keep_partial: commit the bytes of the cut chunk that
        arrived (as Drive may); by default they are lost, the worst case for a client."""
        with self.lock:
            self._cuts.append(at_bytes)
            self.cut_keeps_partial = keep_partial

    def _take_cut(self, before: int, after: int) -> bool:
        with self.lock:
            for at in self._cuts:
                if before < at <= after:
                    self._cuts.remove(at)
                    self.faults_fired.append(("cut", "PUT", f"at byte {at}"))
                    return True
        return False

    def clear_faults(self) -> None:
        with self.lock:
            self._faults.clear()
            self._cuts.clear()

    def _take_fault(self, method: str, target: str) -> Fault | None:
        with self.lock:
            self.requests.append((method, target))
            for spec in self._faults:
                if spec.remaining <= 0 or not spec.matches(f"{method} {target}"):
                    continue
                if spec.skip > 0:
                    spec.skip -= 1
                    continue
                spec.remaining -= 1
                self.faults_fired.append((spec.kind, method, target))
                return spec
        return None
