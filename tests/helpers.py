"""Helpers for tests that run resumable-train as a real subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from resumable.reporting.metrics import read_records, without_timing

BIN = Path(sys.executable).parent


def command(name: str = "resumable-train") -> list[str]:
    exe = BIN / name
    if exe.exists():
        return [str(exe)]
    module = "resumable.cli"
    entry = "train_command" if name == "resumable-train" else "main"
    return [sys.executable, "-c", f"import {module} as m; m.{entry}()"]


def env(**extra: str) -> dict[str, str]:
    merged = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    return merged


def run(args: list[str], name: str = "resumable-train", timeout: float = 300, **extra_env: str):
    return subprocess.run(command(name) + args, capture_output=True, text=True, timeout=timeout,
                          env=env(**extra_env), stdin=subprocess.DEVNULL)


def inspect_json(run_dir: Path) -> dict[str, Any]:
    result = run([ "inspect", "--json", str(run_dir)], name="resumable")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def final_fingerprint(run_dir: Path) -> str:
    latest = inspect_json(run_dir)["latest_valid"]
    assert latest is not None, f"no valid checkpoint in {run_dir}"
    return latest["fingerprint"]


def records(run_dir: Path) -> list[dict[str, Any]]:
    return without_timing(read_records(Path(run_dir) / "metrics.jsonl"))


@contextlib.contextmanager
def small_filesystem(mount_point: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (e.g. "48m") at ``mount_point``, so ENOSPC comes from the kernel; skips the
    test when mounting is not allowed (it needs root)."""
    mount_point.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
