"""engine/state/host_memory.py: resumable-train keeps large freed blocks in glibc's heap on the CPU, and changes
nothing where the C library cannot take the setting."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from resumable.engine.state import host_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_takes_the_setting_and_large_blocks_stop_being_mapped_each_time() -> None:
    """In a fresh process: after the setting, allocating and freeing a 20 MB tensor 50 times faults its pages in
    far fewer times than before it (the blocks are reused instead of mmap'ed and unmapped each time)."""
    probe = (
        "import resource, sys, torch\n"
        "from resumable.engine.state.host_memory import keep_freed_blocks\n"
        "def faults():\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "    for _ in range(50):\n"
        "        torch.ones(5 << 20)\n"
        "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
        "plain = faults()\n"
        "assert keep_freed_blocks()\n"
        "faults()\n"  # the first reuse after the setting may still grow the heap
        "kept = faults()\n"
        "print(plain, kept)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plain, kept = map(int, done.stdout.split())
    assert kept * 10 < plain, (plain, kept)


def test_elsewhere_nothing_is_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory.sys, "platform", "darwin")
    assert host_memory.keep_freed_blocks() is False


def test_a_c_library_without_mallopt_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory.sys, "platform", "linux")

    def missing(*args: object, **kwargs: object) -> object:
        raise OSError("no such library")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert host_memory.keep_freed_blocks() is False
