"""A real Jupyter kernel (ipykernel through jupyter_client) for the notebook tests: cells run as a notebook runs
them, interrupts are the notebook's (SIGINT to the kernel's process group), and a dead kernel is seen as dead."""

from __future__ import annotations

import os
import queue
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

jupyter_client = pytest.importorskip("jupyter_client", reason="the notebook tests need jupyter_client and ipykernel "
                                     "(pip install -e '.[dev]')")
pytest.importorskip("ipykernel", reason="the notebook tests need ipykernel (pip install -e '.[dev]')")


@dataclass
class Cell:
    """What one executed cell produced."""

    stdout: str = ""
    stderr: str = ""
    error: tuple[str, str] | None = None  # (exception name, message) when the cell raised
    done: bool = False  # the kernel went idle after it (False: timed out, or the kernel died)
    outputs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.stdout + self.stderr


class Kernel:
    """One kernel process, started in ``cwd`` with ``env`` added to the test's environment."""

    def __init__(self, cwd: Path, **env: str) -> None:
        self.manager = jupyter_client.KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=str(cwd), env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        self._pending: dict[str, Cell] = {}

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def alive(self) -> bool:
        return self.manager.is_alive()

    def start(self, code: str) -> str:
        """Send a cell without waiting for it (see :meth:`wait`)."""
        msg_id = self.client.execute(code, allow_stdin=False)
        self._pending[msg_id] = Cell()
        return msg_id

    def wait(self, msg_id: str, timeout: float = 180) -> Cell:
        """Collect the cell's output until the kernel is idle after it, or ``timeout`` passes, or the kernel dies."""
        cell = self._pending[msg_id]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                if not self.alive():
                    return cell
                continue
            parent = msg["parent_header"].get("msg_id")
            if parent not in self._pending:
                continue
            target, kind, content = self._pending[parent], msg["msg_type"], msg["content"]
            if kind == "stream":
                if content["name"] == "stdout":
                    target.stdout += content["text"]
                else:
                    target.stderr += content["text"]
            elif kind == "error":
                target.error = (content["ename"], content["evalue"])
            elif kind in ("execute_result", "display_data"):
                target.outputs.append(content)
            elif kind == "status" and content["execution_state"] == "idle":
                target.done = True
                if parent == msg_id:
                    return cell
        return cell

    def run(self, code: str, timeout: float = 180) -> Cell:
        return self.wait(self.start(code), timeout)

    def value(self, expression: str, timeout: float = 60) -> Any:
        """The value of ``expression`` in the kernel (through repr and eval: plain values only)."""
        cell = self.run(f"print(repr({expression}))", timeout)
        assert cell.done and cell.error is None, cell
        return eval(cell.stdout.strip())  # noqa: S307 - our own kernel's repr of a plain value

    def interrupt(self) -> None:
        """The notebook's interrupt button: SIGINT to the kernel's process group."""
        self.manager.interrupt_kernel()

    def kill(self) -> None:
        """The VM going away: SIGKILL, nothing runs after it."""
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def shutdown(self) -> None:
        try:
            self.client.stop_channels()
        finally:
            self.manager.shutdown_kernel(now=True)
