"""The tree digest of format 4: every byte of a shard hashed once, on two cores, for everything a save proves.

A tensor's stored bytes (shardfile.stored_form) are cut into 16 MiB pieces; each piece is hashed alone (sha256)
and the tensor's digest is the sha256 of its pieces' raw 32-byte digests in order (a tensor of no bytes:
``sha256(b"")``). A shard file's digest is::

    sha256(b"resumable-tree-1\\n" + header bytes (8-byte length + JSON, as written) + tensor digests in header order)

Pieces are independent, so they are hashed on a small pool of threads (hashlib releases the GIL on large
buffers) while the writing thread writes the same bytes; the tensor digests (the training-state fingerprint,
digests.py) and the file digest (the manifest's) are derived from the piece digests at almost no cost. The file
digest can be computed from the file alone (shardfile.digest_file: the header is parsed, each tensor's byte
range hashed), which is what verification does, keeping the tensor digests so that a resume does not hash the payload
a second time.

Every hash of a checkpoint file goes through :func:`sha256` (a test or benchmark may wrap it to count bytes).
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from . import paths

KIND = "sha256-tree"  # the manifest entry's "digest" field of a shard hashed this way
MAGIC = b"resumable-tree-1\n"
PIECE = 16 << 20
WORKERS = 2
EMPTY = hashlib.sha256(b"").digest()



class _Workers:
    """Daemon threads that hash pieces handed to them. Daemon, unlike a ThreadPoolExecutor's (which Python joins at
    exit): an idle hashing thread must not keep ``resumable-train`` from ending at once when its work is done
    (cli/exits.exit_now leaves the process at once only when no non-daemon thread is alive; the interpreter's own
    teardown of torch takes ~0.9 s). A piece in flight when the process ends is one nobody waits for any more:
    every save and check waits for its pieces before it commits or returns."""

    def __init__(self, count: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = queue.SimpleQueue()
        for index in range(count):
            threading.Thread(target=self._work, name=f"resumable-digest-{index}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            # The job's arguments (a view of a mapped file) are dropped before its waiter wakes: the waiter closes
            # the mapping next, which fails while a view of it is referenced.
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                del args
                future.set_exception(e)
            else:
                del args
                future.set_result(result)
                del result
            del future, fn


_pool: _Workers | None = None
_pool_lock = threading.Lock()


def _forget_workers() -> None:
    """In a forked child the workers do not exist (only the forking thread survives a fork): start new ones there."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_workers)


def sha256(data: Any = b"") -> Any:
    """hashlib.sha256: the one function checkpoint bytes are hashed with (wrapped by tests to count them)."""
    return hashlib.sha256(data)


def _workers() -> _Workers:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = _Workers(WORKERS)
    return _pool


def _piece(view: memoryview) -> bytes:
    return sha256(view).digest()


class TensorHash:
    """One tensor's digest, fed with its stored bytes in order (views whose sizes are multiples of PIECE, but the
    last); the pieces are hashed on the pool."""

    def __init__(self) -> None:
        self._pieces: list[Future[bytes]] = []
        self._tail = 0  # bytes of an incomplete last piece seen: nothing may follow it

    def add(self, view: memoryview) -> list[Future[bytes]]:
        """Hash ``view`` (bytes) in pieces; the futures are done once its memory may be reused (a bounce buffer)."""
        assert self._tail == 0, "only the last view of a tensor may end inside a piece"
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        futures = [_workers().submit(_piece, view[start:start + PIECE]) for start in range(0, len(view), PIECE)]
        self._tail = len(view) % PIECE
        self._pieces.extend(futures)
        return futures

    def digest(self) -> bytes:
        """The tensor's raw digest (waits for its pieces)."""
        if not self._pieces:
            return EMPTY
        return sha256(b"".join(future.result() for future in self._pieces)).digest()


def wait(futures: Iterable[Future[Any]]) -> None:
    for future in futures:
        future.result()


def file_digest(head: bytes, tensor_digests: Iterable[bytes]) -> str:
    """The hex digest of a shard file from its header bytes and its tensors' raw digests in header order."""
    digest = sha256(MAGIC + head)
    for raw in tensor_digests:
        digest.update(raw)
    return digest.hexdigest()


class FileDigests:
    """What shardfile.digest_file found: the file's digest, each tensor's (key -> hex), and the file's identity when
    it was read (inode, size, mtime), so a later reader can tell whether it still is the file that was hashed."""

    def __init__(self, digest: str, tensors: dict[str, str], identity: tuple[int, int, int, int]) -> None:
        self.digest, self.tensors, self.identity = digest, tensors, identity

    def current(self, path: Path) -> bool:
        """Whether ``path`` is still the file hashed (same device, inode, size and modification time)."""
        try:
            return identity(paths.regular_stat(path)) == self.identity
        except OSError:
            return False


def identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns
