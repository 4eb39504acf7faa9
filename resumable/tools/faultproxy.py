"""A fault-injecting HTTP forwarding proxy for Drive API traffic (`resumable chaos --fault drive`).

The training run's Drive calls go to ``RESUMABLE_DRIVE_ENDPOINT``; chaos points that at this proxy, which forwards
every request (method, path and query, headers, body) to the real endpoint and relays the answer, except for the
one request a fault has been armed for (:meth:`FaultProxy.arm`):

- ``503`` / ``429``: answered by the proxy with a Drive-style JSON error; nothing reaches Drive.
- ``stall``: forwarded (the change lands on Drive), then the answer is held past the client's timeout and the
  connection closed: an answer lost after the change landed.
- ``drop``: the request is read, then the connection is reset (RST) without an answer; nothing reaches Drive.

The proxy then watches the client's next requests to the same URL until one is answered (not 429/5xx): that is
when the fault was dealt with, after how many retries, and whether an upload continued from the bytes Drive
acknowledged (a ``Content-Range: bytes */N`` status query).

>>> with FaultProxy("https://www.googleapis.com", stall_s=61) as proxy:
...     proxy.arm("503")  # the next Drive call gets a 503; RESUMABLE_DRIVE_ENDPOINT=proxy.url
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("503", "429", "stall", "drop")
_ERRORS = {"503": ("global", "backendError", "Service Unavailable"),
           "429": ("usageLimits", "rateLimitExceeded", "Too Many Requests")}
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host",
        "content-length"}
_UPSTREAM_TIMEOUT_S = 300.0


@dataclass
class Fired:
    """One injected fault and what the client did about it."""

    kind: str
    method: str
    target: str  # path?query
    at: float  # time.monotonic() when it fired
    retries: int = 0  # requests to the same URL after it, up to and including the one answered
    recovered_at: float | None = None
    continued_at: int | None = None  # an upload's status query: the byte Drive acknowledged, where it went on

    @property
    def recovered_s(self) -> float | None:
        return self.recovered_at - self.at if self.recovered_at is not None else None

    @property
    def request(self) -> str:
        """The request in words, e.g. ``PUT upload`` or ``GET list``, for the report."""
        path = self.target.split("?", 1)[0]
        what = ("upload" if "/upload/" in path else "list" if self.method == "GET" and path.endswith("/files")
                else "download" if "alt=media" in self.target else "metadata")
        return f"{self.method} {what}"


class FaultProxy:
    """Forward to ``upstream`` (``http(s)://host[:port]``), injecting the armed faults; ``stall_s``: how long a
    stall holds its answer (longer than the client's HTTP timeout)."""

    def __init__(self, upstream: str, stall_s: float) -> None:
        parts = urlsplit(upstream)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"RESUMABLE_DRIVE_ENDPOINT={upstream!r} is not an http(s)://host[:port] base URL; "
                             "unset it for the real Drive API")
        self.upstream = upstream.rstrip("/")
        self._parts = parts
        self.stall_s = stall_s
        self.lock = threading.Lock()
        self.fired: list[Fired] = []
        self.requests = 0
        self._armed: tuple[str, str] | None = None  # (kind, match)
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the proxy first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.block_on_close = False
        server.proxy = self  # type: ignore[attr-defined]
        self._server = server
        threading.Thread(target=server.serve_forever, args=(0.05,), name="fault-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()  # wakes stalled answers
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def arm(self, kind: str, match: str = "") -> None:
        """The next request (whose ``METHOD path?query`` contains ``match``) gets ``kind``, one of :data:`KINDS`."""
        if kind not in KINDS:
            raise ValueError(f"unknown Drive fault {kind!r}: one of {', '.join(KINDS)}")
        with self.lock:
            self._armed = (kind, match)

    def disarm(self) -> str | None:
        """Drop an armed fault that has not fired; returns it."""
        with self.lock:
            armed, self._armed = self._armed, None
            return armed[0] if armed is not None else None

    # called by the handler
    def take(self, method: str, target: str) -> str | None:
        """The fault this request gets (recorded as fired), or None; counts it as a retry of a pending fault."""
        with self.lock:
            self.requests += 1
            pending = self._pending(method, target)
            if pending is not None:
                pending.retries += 1
            if self._armed is None or self._armed[1] not in f"{method} {target}":
                return None
            kind, self._armed = self._armed[0], None
            self.fired.append(Fired(kind, method, target, time.monotonic()))
            return kind

    def answered(self, method: str, target: str, status: int, headers: http.client.HTTPMessage,
                 status_query: str | None) -> None:
        """An upstream answer; ``status_query``: the request's ``Content-Range`` when it was ``bytes */N``."""
        with self.lock:
            pending = self._pending(method, target)
            if pending is None or status == 429 or status >= 500:
                return
            pending.recovered_at = time.monotonic()
            if status_query is not None:  # 308 "Range: bytes=0-K": Drive holds K+1 bytes; 200/201: all N
                held = headers.get("Range") or ""
                total = status_query.rsplit("/", 1)[1]
                pending.continued_at = (int(held.rsplit("-", 1)[1]) + 1 if held.startswith("bytes=") else
                                        0 if status == 308 else int(total) if total.isdigit() else None)

    def _pending(self, method: str, target: str) -> Fired | None:
        for fired in reversed(self.fired):
            if fired.recovered_at is None and fired.method == method and fired.target == target:
                return fired
        return None

    def forward(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes | None):
        """Send the request upstream; (status, reason, headers, body)."""
        parts = self._parts
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = kind(parts.hostname, parts.port, timeout=_UPSTREAM_TIMEOUT_S)
        try:
            sent = [(k, v) for k, v in headers if k.lower() not in _HOP]
            connection.putrequest(method, parts.path.rstrip("/") + target, skip_accept_encoding=True)
            for key, value in sent:
                connection.putheader(key, value)
            connection.putheader("Content-Length", str(len(body or b"")))
            connection.endheaders(body)
            answer = connection.getresponse()
            return answer.status, answer.reason, answer.msg, answer.read()
        finally:
            connection.close()

    def relayed(self, value: str) -> str:
        """A Location naming the upstream names this proxy, so the upload's next chunks come here too."""
        return self.url + value[len(self.upstream):] if value.startswith(self.upstream) else value

    def wait_stall(self) -> None:
        self._stop.wait(self.stall_s)


def reset_connection(handler: BaseHTTPRequestHandler) -> None:
    """Close ``handler``'s connection with RST (SO_LINGER on, 0 s), as a dying NAT or proxy does. The makefile()
    reader holds a reference to the socket, so it is closed first, or the connection would stay open."""
    handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    handler.rfile.close()
    handler.wfile.close()
    handler.connection.close()
    handler.rfile, handler.wfile = io.BytesIO(), io.BytesIO()  # harmless targets for the server's own teardown
    handler.close_connection = True


def error_body(kind: str) -> bytes:
    domain, reason, message = _ERRORS[kind]
    code = int(kind)
    return json.dumps({"error": {"errors": [{"domain": domain, "reason": reason, "message": message}],
                                 "code": code, "message": message}}).encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httplib2 expects

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    def _handle(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        kind = proxy.take(self.command, self.path)
        if kind == "drop":
            self._reset()
            return
        if kind in _ERRORS:
            self._answer(int(kind), [("Content-Type", "application/json; charset=UTF-8")], error_body(kind))
            return
        try:
            status, _, headers, data = proxy.forward(self.command, self.path, list(self.headers.items()), body)
        except OSError as e:  # the client retries a 502 like any other
            message = f"the chaos fault proxy could not reach {proxy.upstream}: {e}"
            data = json.dumps({"error": {"code": 502, "message": message}}).encode()
            self._answer(502, [("Content-Type", "application/json")], data)
            return
        if kind == "stall":  # it landed; the answer never comes
            proxy.wait_stall()
            self.close_connection = True
            return
        asked = self.headers.get("Content-Range") or ""
        proxy.answered(self.command, self.path, status, headers, asked if asked.startswith("bytes */") else None)
        relayed = [(k, proxy.relayed(v) if k.lower() == "location" else v) for k, v in headers.items()
                   if k.lower() not in _HOP and k.lower() not in ("date", "server")]
        self._answer(status, relayed, data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle  # noqa: N815 - http.server's names

    def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        try:
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up; nothing to answer
            self.close_connection = True

    def _reset(self) -> None:
        reset_connection(self)
