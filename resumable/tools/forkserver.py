"""Warm restarts for `resumable chaos --warm`, and the one way chaos calls a Python target.

A cold restart pays for a new interpreter and ``import torch`` (about 1.5-2.5 s on a small CPU) before
the engine does anything. That is real on a fresh Colab VM, but it is not the engine's cost, and at a kill
every 20 s it hides what the engine loses. The fork server imports torch and the target's module once, then
forks a fresh training process for every (re)start: each child is a separate process that is killed for
real, and its restart time is only what the engine spends (parsing, lock, restore, data load, first step).

A target is ``MODULE:FUNCTION`` or ``FILE.py:FUNCTION`` (called as ``FUNCTION(argv)``; an int it returns, or
the ``exit_code`` of what it returns, is the exit code) or ``FILE.py`` (run as ``__main__``, like ``python
FILE.py``). ``sys.argv`` is ``[program, *argv]`` either way, so a ``main()`` that parses ``sys.argv`` works.

Protocol over a SOCK_SEQPACKET socket pair, one JSON message each: the server sends ``{"ready": true}``
after its imports (or ``{"error"}``); a request ``{"args", "env", "cwd"}`` carries the write end of the
child's stderr pipe as SCM_RIGHTS; the server answers ``{"pid"}``, waits for the child and sends
``{"returncode"}`` (negative signal number like ``subprocess``). The server is single-threaded and forks one
child at a time.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from ..faults import install_from_env

_MAX = 1 << 20
TRAIN_TARGET = "resumable.cli:train_command"  # what `resumable-train` runs


def _send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def _script_and_function(target: str) -> tuple[str | None, str | None, str | None]:
    """``target`` -> (module, file, function); exactly one of module and file is set."""
    where, _, function = target.rpartition(":") if ":" in target else (target, "", None)
    if where.endswith(".py") or os.sep in where:
        return None, str(Path(where).resolve()), function
    return where, None, function


def load(target: str) -> tuple[str, Callable[[list[str]], object]]:
    """Import ``target``; return its program name (``sys.argv[0]``) and a callable of the argument list.

    Imports (a function's module) happen here, so the fork server pays them once, before any fork."""
    module_name, path, function = _script_and_function(target)
    if target == TRAIN_TARGET:
        from ..tasks import mnist_task  # noqa: F401 - imported lazily by train_command; pay it once too
    if path is not None:
        sys.path.insert(0, str(Path(path).parent))  # what `python FILE.py` does, for the script's own imports
        if function is None:
            return path, lambda argv: runpy.run_path(path, run_name="__main__")
        name = Path(path).stem if Path(path).stem not in sys.modules else f"_chaos_target_{Path(path).stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"{path} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        if function is None:
            raise ValueError(f"{target} names a module; add the function to call, e.g. {target}:main")
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m`: a module beside the command is found
        module = importlib.import_module(module_name)
    obj = module
    for part in function.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{target} is a {type(obj).__name__}, not a function")
    return ("resumable-train" if target == TRAIN_TARGET else path or module_name), obj


def _exit_code(result: object) -> int:
    code = getattr(result, "exit_code", result)  # e.g. a resumable.Run or a TaskResult
    return code if isinstance(code, int) and not isinstance(code, bool) else 0


def _system_exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)  # sys.exit("message"), as the interpreter does
    return 1


def call(program: str, function: Callable[[list[str]], object], args: list[str]) -> int:
    """Run the target in this process as its own program; return its exit code (never raises)."""
    sys.argv = [program, *args]
    install_from_env()  # chaos's child bootstrap: this child's faults (its environment is the request's)
    try:
        return _exit_code(function(list(args)))
    except SystemExit as e:
        return _system_exit_code(e)
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException:  # noqa: BLE001 - a traceback and exit 1, as the interpreter does
        traceback.print_exc()
        return 1


def main(argv: list[str]) -> None:
    """Cold start: ``python -c '...main(sys.argv[1:])' TARGET ARGS...`` runs TARGET with ARGS."""
    target, args = argv[0], argv[1:]
    try:
        program, function = load(target)
    except Exception as e:  # noqa: BLE001 - reported, exit 2 (a bad target, not a training failure)
        print(f"resumable chaos: cannot load --target {target}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(call(program, function, args))


def _child(sock: socket.socket, request: dict, err_fd: int, program: str, function: Callable) -> None:
    """In the forked child: become the target with the request's argv, stdio, env and cwd."""
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
        code = call(program, function, request["args"])
    except BaseException:  # noqa: BLE001 - the child must never return into the server's loop
        traceback.print_exc()
    finally:
        from .. import log  # imported already: the server imported resumable before forking

        log.flush_outputs()
        os._exit(code)


def serve(fd: int, target: str = TRAIN_TARGET) -> None:
    import torch  # noqa: F401 - the point of the server: imported once, before any fork
    import torch._dynamo  # noqa: F401 - creating any optimizer imports it (~1.4 s), in every process

    import resumable  # noqa: F401 - what a user's script imports first

    sock = socket.socket(fileno=fd)
    try:
        program, function = load(target)
    except Exception as e:  # noqa: BLE001 - reported to chaos, which names the target
        _send(sock, {"error": f"cannot load --target {target}: {type(e).__name__}: {e}"})
        return
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
            _child(sock, json.loads(data), fds[0], program, function)
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
    """Starts the server process (which imports ``target``) and forks target processes through it, one at a
    time. ``RuntimeError`` if the target cannot be loaded."""

    def __init__(self, target: str = TRAIN_TARGET) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = f"from resumable.tools.forkserver import serve; serve({theirs.fileno()}, {target!r})"
        self._proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                      stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        reply = self.receive(block=True)
        if not reply.get("ready"):
            self.close()
            raise RuntimeError(reply.get("error") or "the fork server did not start")

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
