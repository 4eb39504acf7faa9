"""Helpers for tests that run resumable-train as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from resumable.metrics import read_records, without_timing

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
