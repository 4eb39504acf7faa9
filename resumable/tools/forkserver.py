"""Warm restarts for `resumable chaos --warm`.

A cold restart pays for a new interpreter and ``import torch`` (about 1.5-2.5 s on a small CPU) before
the engine does anything. That is real on a fresh Colab VM, but it is not the engine's cost, and at a kill
every 20 s it hides what the engine loses. The fork server imports torch and resumable once, then forks a
fresh training process for every (re)start: each child is a separate process that is killed for real, and
its restart time is only what the engine spends (parsing, lock, restore, data load, first step).

Protocol over a SOCK_SEQPACKET socket pair, one JSON message each: the server sends ``{"ready": true}``
after its imports; a request ``{"args", "env", "cwd"}`` carries the write end of the child's stderr pipe
as SCM_RIGHTS; the server answers ``{"pid"}``, waits for the child and sends ``{"returncode"}`` (negative
signal number like ``subprocess``). The server is single-threaded and forks one child at a time.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import traceback

_MAX = 1 << 20


def _send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _child(sock: socket.socket, request: dict, err_fd: int) -> None:
    """In the forked child: become `resumable-train ARGS` with the request's stdio, env and cwd."""
    code = 1
    try:
        sock.close()
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err_fd, 2)
        os.close(err_fd)
        os.close(null)
        for name in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(name, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        from ..cli import train_command

        train_command.main(request["args"], prog_name="resumable-train", standalone_mode=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child must never return into the server's loop
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve(fd: int) -> None:
    import torch  # noqa: F401 - the point of the server: imported once, before any fork
    import torch._dynamo  # noqa: F401 - creating any optimizer imports it (~1.4 s), in every process

    from .. import cli  # noqa: F401
    from ..tasks import mnist_task  # noqa: F401

    sock = socket.socket(fileno=fd)
    _send(sock, {"ready": True})
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX, 1)
        except OSError:
            return
        if not data:
            return
        pid = os.fork()
        if pid == 0:
            _child(sock, json.loads(data), fds[0])
        os.close(fds[0])
        _send(sock, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(sock, {"returncode": os.waitstatus_to_exitcode(status)})


class WarmProcess:
    """The parts of ``subprocess.Popen`` that chaos uses, for a child forked by the server."""

    def __init__(self, server: ForkServer, pid: int, stderr: io.TextIOBase) -> None:
        self._server = server
        self.pid = pid
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            reply = self._server.receive(block=False)
            if reply is not None:
                self.returncode = reply["returncode"]
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self._server.receive(block=True)["returncode"]
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # exited between the poll and the kill
                pass

    def communicate(self) -> tuple[None, str]:
        err = self.stderr.read()
        self.wait()
        return None, err


class ForkServer:
    """Starts the server process and forks training processes through it, one at a time."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = f"from resumable.tools.forkserver import serve; serve({theirs.fileno()})"
        self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                      stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        if not self.receive(block=True).get("ready"):
            raise RuntimeError("the fork server did not start")

    def receive(self, block: bool) -> dict | None:
        try:
            data = self._sock.recv(_MAX, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        if not data:
            raise RuntimeError(f"the fork server exited (code {self._proc.wait()})")
        return json.loads(data)

    def spawn(self, args: list[str], env: dict[str, str]) -> WarmProcess:
        read_fd, write_fd = os.pipe()
        try:
            _send(self._sock, {"args": args, "env": env, "cwd": os.getcwd()}, [write_fd])
        finally:
            os.close(write_fd)
        pid = self.receive(block=True)["pid"]
        return WarmProcess(self, pid, open(read_fd, encoding="utf-8", errors="replace"))

    def close(self) -> None:
        self._sock.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
