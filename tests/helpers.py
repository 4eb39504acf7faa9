"""Helpers for tests that run resumable-train as a real subprocess."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.checkpoint.manager import CheckpointInfo
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


def newest_valid(run_dir: Path) -> CheckpointInfo:
    """The newest fully verified checkpoint, as a resume and `resumable inspect` judge it (in this process: a
    `resumable inspect` subprocess costs ~1.8 s of importing torch; test_inspect.py covers the command itself)."""
    latest, skipped = CheckpointManager(checkpoints_dir(Path(run_dir))).latest_valid()
    assert latest is not None, f"no valid checkpoint in {run_dir}: {[(i.step, i.reason) for i in skipped]}"
    return latest


def final_fingerprint(run_dir: Path) -> str:
    return newest_valid(run_dir).fingerprint


def records(run_dir: Path) -> list[dict[str, Any]]:
    return without_timing(read_records(Path(run_dir) / "metrics.jsonl"))


def train_script(script: Path, main: Any, args: list[str], faults: Any = None, **extra_env: str
                 ) -> subprocess.CompletedProcess:
    """A test training script (tests/stream_train.py, tests/sampler_train.py): in this process through its ``main``
    (fast) without ``faults``; as its own process with them (a resumable.faults.Faults, e.g. a SIGKILL at a step)."""
    if faults is None:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            code = main(args)
        return subprocess.CompletedProcess(args, code, "", stderr.getvalue())
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                          env=env(**extra_env, **faults.to_env()), stdin=subprocess.DEVNULL)


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


# -- the payload files of a checkpoint (format 3: shards and meta.pt; formats 1 and 2: state.pt) ---------------
def shards(step_dir: Path) -> list[Path]:
    """The tensor shards of a format 3 step dir (``shard-*.safetensors``), in order."""
    from resumable.checkpoint import format as fmt

    return sorted(p for p in Path(step_dir).glob("shard-*.safetensors") if fmt.TMP_MARK not in p.name)


def payload_files(step_dir: Path) -> list[Path]:
    """Every payload file of a step dir: what is there besides ``manifest.json`` and temp files (format 3:
    ``meta.pt`` and the shards; formats 1 and 2: ``state.pt``)."""
    from resumable.checkpoint import format as fmt

    return sorted(p for p in Path(step_dir).iterdir() if p.name != fmt.MANIFEST and fmt.TMP_MARK not in p.name)


def replace_bytes(path: Path, data: bytes) -> None:
    """Give ``path`` new content as a new file. A shard equal to the previous checkpoint's is a hard link to
    it, so writing the existing file in place would damage the older checkpoint too."""
    path = Path(path)
    path.unlink()
    path.write_bytes(data)


def rewrite_payload(step_dir: Path, change) -> dict[str, Any]:  # noqa: ANN001 - a function of the state
    """Load a checkpoint's state, apply ``change`` to it and write it back in the current format, re-signed
    (files, fingerprint and seal of the manifest), so only its content is wrong, not its integrity. Returns
    the new state."""
    from resumable.checkpoint import format as fmt
    from resumable.checkpoint.manager import read_any
    from resumable.checkpoint.manifest import seal
    from resumable.checkpoint.sharded import ShardedFormat

    step_dir = Path(step_dir)
    manifest = json.loads((step_dir / fmt.MANIFEST).read_text())
    state = read_any(step_dir, manifest)
    change(state)
    for name in manifest["files"]:  # new files, never written in place (shards may be linked elsewhere)
        (step_dir / name).unlink()
    written = ShardedFormat().begin(step_dir, state).finish()
    manifest.update(files=written.files, fingerprint=written.fingerprint,
                    fingerprint_version=written.fingerprint_version)
    (step_dir / fmt.MANIFEST).write_text(json.dumps(seal(manifest)))
    return state


def policies(run_dir: Any = None, **flat: Any) -> dict[str, Any]:
    """Flat option names (``max_steps=3, checkpoint_steps=2, progress=False``...) as the Run's policy keyword
    arguments (``session=Session(max_steps=3)``...): tests combine many options through their helpers; training code
    writes the records themselves. With ``run_dir`` it is one of them too, a Location when Drive options
    (``cache_dir``, ``drive_credentials``, ``drive_flush_timeout``) are given."""
    from dataclasses import fields

    from resumable.policies import _ENGINE_NAMES, Checkpointing, Loader, Location, Reporting, Session

    def taken(record: type) -> dict[str, Any]:
        """The flat options that are ``record``'s fields (under the engine's names), as its keyword arguments."""
        engine = {**_ENGINE_NAMES, "options": "loader_options"} if record is Loader else _ENGINE_NAMES
        return {f.name: flat.pop(engine.get(f.name, f.name)) for f in fields(record)
                if f.name != "path" and engine.get(f.name, f.name) in flat}

    out: dict[str, Any] = {}
    where = taken(Location)
    if run_dir is not None:
        out["run_dir"] = Location(run_dir, **where) if where else run_dir
    elif where:
        raise TypeError(f"{sorted(where)} need the run_dir: policies(run_dir=..., ...)")
    for keyword, record in (("loader", Loader), ("checkpointing", Checkpointing), ("session", Session),
                            ("reporting", Reporting)):
        given = taken(record)
        if given:
            out[keyword] = record(**given)
    return {**flat, **out}  # the rest (epochs, tracker, objects...) as they are


def wait_for(proc: subprocess.Popen, ready: Any, what: str, timeout: float = 240) -> None:
    """Poll ``ready()`` while ``proc`` runs; fail (with its stderr) if it ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the run ended (or took too long) before {what}:\n{err[-3000:]}")
        time.sleep(0.02)
