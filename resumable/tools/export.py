"""``resumable export``: write a run's model weights as a plain state_dict file.

The output loads without resumable: ``model.load_state_dict(torch.load("model.pt", weights_only=True))``.
"""

from __future__ import annotations

import math
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import click
import torch

from ..checkpoint import CheckpointInfo, CheckpointManager, InvalidCheckpoint, checkpoints_dir
from ..checkpoint.format import fsync_dir
from ..errors import ResumableError

# Wrapper prefixes on parameter names: torch.compile (``_orig_mod.``) and DistributedDataParallel (``module.``).
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class ExportError(ResumableError):
    """Nothing suitable to export, or the output cannot be written; the message says what to do."""


def checkpoint_to_export(run_dir: Path, best: bool = False) -> CheckpointInfo:
    """The newest fully verified checkpoint of ``run_dir``, or with ``best`` the valid one with the highest
    test_acc (ties: the newest)."""
    manager = CheckpointManager(checkpoints_dir(run_dir))
    if not best:
        info, skipped = manager.latest_valid()
        if info is not None:
            return info
        if not skipped:
            raise ExportError(f"no checkpoints in {run_dir}: train first (resumable-train --run-dir {run_dir})")
        raise ExportError(f"no valid checkpoint in {run_dir} ({len(skipped)} invalid): see resumable inspect "
                          f"{run_dir}")
    infos = manager.inspect(deep=True)
    valid = [i for i in infos if i.valid]
    if not infos:
        raise ExportError(f"no checkpoints in {run_dir}: train first (resumable-train --run-dir {run_dir})")
    if not valid:
        raise ExportError(f"no valid checkpoint in {run_dir} ({len(infos)} invalid): see resumable inspect "
                          f"{run_dir}")
    scored = [i for i in valid if _is_number(i.test_acc)]
    if not scored:
        raise ExportError(f"--best: no valid checkpoint in {run_dir} records test_acc; export the newest "
                          f"without --best")
    return max(scored, key=lambda i: (i.test_acc, i.step))


def export_model(run_dir: Path, out: Path, best: bool = False) -> tuple[CheckpointInfo, Path]:
    """Write the model state_dict of the chosen checkpoint to ``out`` atomically; returns (checkpoint, out)."""
    out = Path(out)
    if out.is_dir():
        raise ExportError(f"--out {out} is a directory; give a file path such as {out / 'model.pt'}")
    info = checkpoint_to_export(Path(run_dir), best)
    try:
        payload = CheckpointManager(checkpoints_dir(run_dir)).load(info)
    except InvalidCheckpoint as e:
        raise ExportError(f"cannot load {info.path}: {e}") from e
    model = payload.get("model")
    if not isinstance(model, dict) or not model:
        raise ExportError(f"{info.path} holds no model weights (payload has no 'model' state_dict)")
    state = strip_wrapper_prefixes(model)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _save_atomic(state, out)
    except OSError as e:
        raise ExportError(f"cannot write {out}: {e}") from e
    return info, out


def strip_wrapper_prefixes(state: dict[str, Any]) -> OrderedDict[str, Any]:
    """A CPU copy of ``state`` with wrapper prefixes that every key shares removed (repeatedly, in any order)."""
    keys = list(state)
    metadata = dict(getattr(state, "_metadata", None) or {})
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if keys and all(k.startswith(prefix) for k in keys):
                keys = [k[len(prefix):] for k in keys]
                metadata = _strip_metadata(metadata, prefix)
                stripped = True
    result: OrderedDict[str, Any] = OrderedDict()
    for key, value in zip(keys, state.values(), strict=True):
        result[key] = value.detach().to("cpu").contiguous().clone() if isinstance(value, torch.Tensor) else value
    if metadata:
        result._metadata = metadata  # type: ignore[attr-defined]  # module versions, as nn.Module.state_dict keeps
    return result


def _strip_metadata(metadata: dict[str, Any], prefix: str) -> dict[str, Any]:
    name = prefix.rstrip(".")
    return {("" if k == name else k[len(prefix):]): v for k, v in metadata.items()
            if k == name or k.startswith(prefix)}


def _save_atomic(obj: Any, out: Path) -> None:
    """torch.save to a temp file beside ``out``, fsync, then rename: ``out`` is never a half-written file."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out.parent)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@click.command("export", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="File to write the model state_dict to (e.g. model.pt).")
@click.option("--best", is_flag=True, help="Export the valid checkpoint with the highest test_acc, not the newest.")
def export_command(run_dir: Path, out: Path, best: bool) -> None:
    """Export the model weights of RUN_DIR's newest valid checkpoint as a plain state_dict.

    Load it without resumable: model.load_state_dict(torch.load("model.pt", weights_only=True)).
    """
    try:
        info, out = export_model(run_dir, out, best)
    except ExportError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    acc = f"{info.test_acc:.4f}" if _is_number(info.test_acc) else "-"
    epoch = info.epoch if info.epoch is not None else "-"
    click.echo(f"exported model weights of step {info.step} (epoch {epoch}, test_acc {acc}) from {info.path} "
               f"to {out}")
