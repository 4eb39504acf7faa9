"""``FakeDrive``: the store, API and fault knobs served on 127.0.0.1, plus starting and stopping the server."""

from __future__ import annotations

import socket
import threading

from .api import DriveApi
from .faults import FaultInjector
from .handler import _Handler, _Server

DEFAULT_TOKEN = "fake-token"


class FakeDrive(DriveApi, FaultInjector):
    """In-memory Drive v2 served over loopback HTTP.

    upload_chunk_limit: commit at most this many bytes per resumable PUT and answer 308, as real Drive may; this
        forces multi-request uploads even though pydrive2 always sends 100 MiB chunks.
    quota_bytes: total storage; uploads that would exceed it fail with 403 storageQuotaExceeded.
    token: bearer token every API call must carry (None disables the check).
    stall_seconds: how long a "stall" fault holds its answer unless ``inject`` says otherwise.
    bandwidth: bytes/s at which request bodies are read (None: as fast as they come), to make uploads take time.
    latency_s: added before each request is handled, like a round trip to a far server.
    """

    def __init__(
        self,
        *,
        token: str | None = DEFAULT_TOKEN,
        upload_chunk_limit: int | None = None,
        quota_bytes: int | None = None,
        stall_seconds: float = 3.0,
        bandwidth: float | None = None,
        latency_s: float = 0.0,
    ) -> None:
        DriveApi.__init__(self, token=token, quota_bytes=quota_bytes, upload_chunk_limit=upload_chunk_limit)
        FaultInjector.__init__(self, stall_seconds)
        self.requests: list[tuple[str, str]] = []  # (method, path?query), in arrival order
        self.responses: list[tuple[str, str, int]] = []  # (method, path?query, status) of each reply written
        self.upload_ranges: list[str] = []  # Content-Range of every resumable-session PUT, e.g. "bytes */4096"
        self.bandwidth = bandwidth
        self.latency_s = latency_s
        self.upload_bytes: dict[str, int] = {}  # body bytes received by each resumable upload session (id)
        self.server_errors: list[str] = []  # tracebacks of bugs in the fake itself; tests assert it stays empty
        self._connections: set[socket.socket] = set()  # open client connections, cut on stop()
        self._stop = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def count_upload(self, session: str | None, nbytes: int) -> bool:
        """Count ``nbytes`` more received by an upload session; True when an armed cut_upload fires now."""
        if session is None:
            return False
        with self.lock:
            before = self.upload_bytes.get(session, 0)
            self.upload_bytes[session] = before + nbytes
            return self._take_cut(before, before + nbytes)

    def received_upload_bytes(self) -> int:
        """Body bytes received by all resumable upload sessions, re-sent ones included."""
        with self.lock:
            return sum(self.upload_bytes.values())

    # lifecycle
    def start(self) -> FakeDrive:
        server = _Server(("127.0.0.1", 0), _Handler)
        server.drive = self
        self._server = server
        # A short poll interval keeps stop() (which waits for the serve loop to notice) fast.
        self._thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="fake-drive", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()  # wake stalled handlers
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self.lock:
            connections, self._connections = list(self._connections), set()
        for conn in connections:  # otherwise keep-alive handler threads would keep serving a "stopped" fake
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> FakeDrive:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "FakeDrive not started"
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
