"""The HTTP layer: a threading server and a request handler that acts out faults and writes ``Reply`` objects.

The handler knows HTTP and sockets; what a request means is ``FakeDrive.dispatch``'s business.
"""

from __future__ import annotations

import socket
import sys
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from resumable.tools.faultproxy import reset_connection

from .faults import fault_reply
from .replies import Reply

if TYPE_CHECKING:
    from .server import FakeDrive

_REASON_PHRASES = {308: "Resume Incomplete"}  # Google's name for 308 in resumable uploads


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # keep-alive client connections must not block stop()
    drive: FakeDrive

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # a client hung up or reset (timeouts, drop tests): routine, not a bug
            return
        with self.drive.lock:
            self.drive.server_errors.append(traceback.format_exc())


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive, like Google's front end; httplib2 reuses connections
    timeout = 30  # reap idle keep-alive connections instead of leaking threads

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes; without NODELAY, Nagle + delayed ACK add ~40 ms per call.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.drive.lock:
            self.server.drive._connections.add(self.connection)

    def finish(self) -> None:
        with self.server.drive.lock:
            self.server.drive._connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # pytest output stays clean; FakeDrive.requests is the log

    def _serve(self) -> None:
        drive: FakeDrive = self.server.drive
        method, target = self.command, self.path
        fault = drive._take_fault(method, target)
        session = (parse_qs(urlsplit(target).query).get("upload_id") or [None])[-1]
        if session is not None:
            with drive.lock:
                drive.upload_ranges.append(self.headers.get("Content-Range", ""))
        if drive.latency_s:
            drive._stop.wait(drive.latency_s)
        length = int(self.headers.get("Content-Length") or 0)
        if fault and fault.kind == "drop":
            partial = self.rfile.read(length // 2)
            drive.count_upload(session, len(partial))
            drive.absorb_partial(target, self.headers, partial)
            self._reset()
            return
        body = self._read_body(drive, session, length)
        if body is None:  # cut off (a cut_upload, or the client went away mid-body)
            return
        if fault and fault.kind == "close":
            self.close_connection = True  # the server then shuts the socket down cleanly, with no reply
            return
        reply = fault_reply(fault.kind) if fault else None  # status and HTML faults answer instead of the API
        if reply is None:
            reply = drive.dispatch(method, target, self.headers, body)
            if fault and fault.kind == "stall":
                drive._stop.wait(fault.seconds)  # the change is already applied; only the answer is late
            if fault and fault.kind == "lost":  # the change is applied; its answer never arrives
                self._reset()
                return
        self._write(drive, reply)

    def _read_body(self, drive: FakeDrive, session: str | None, length: int) -> bytes | None:
        """The request body, read at ``drive.bandwidth`` bytes/s (None: at once), its bytes counted per upload
        session. None when the connection ended mid-body: an armed ``cut_upload`` reset it (the bytes that arrived
        are kept only if it says so), or the client went away (what arrived is kept, as Drive may)."""
        if not length:
            return b""
        if session is None and drive.bandwidth is None:
            return self.rfile.read(length)
        parts: list[bytes] = []
        got, started = 0, time.monotonic()
        while got < length:
            piece = self.rfile.read(min(64 * 1024, length - got))
            if not piece:
                break
            parts.append(piece)
            got += len(piece)
            if drive.count_upload(session, len(piece)):
                if drive.cut_keeps_partial:
                    drive.absorb_partial(self.path, self.headers, b"".join(parts))
                self._reset()
                return None
            if drive.bandwidth:
                ahead = got / drive.bandwidth - (time.monotonic() - started)
                if ahead > 0 and drive._stop.wait(ahead):
                    break
        body = b"".join(parts)
        if got < length:
            drive.absorb_partial(self.path, self.headers, body)
            self.close_connection = True
            return None
        return body

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def _write(self, drive: FakeDrive, reply: Reply) -> None:
        # Record first: once the bytes are out, the client may look at FakeDrive.responses before this thread runs on.
        with drive.lock:
            drive.responses.append((self.command, self.path, reply.status))
        try:
            self.send_response(reply.status, _REASON_PHRASES.get(reply.status))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)
            self.wfile.flush()
        except OSError:  # the client gave up (e.g. after a stall); nothing to answer
            self.close_connection = True

    def _reset(self) -> None:
        reset_connection(self)  # RST, as the shipped fault proxy sends it
