"""``resumable export``: write a run's model weights as a plain state_dict file.

The output loads without resumable: ``model.load_state_dict(torch.load("model.pt", weights_only=True))``. A run
whose frozen tensors were not stored (a LoRA base) exports the trained tensors only, and says so. A sharded (FSDP)
checkpoint's weights are gathered from every rank's DCP files into the one file.

``--out`` is checked before anything is read or written: a path inside the run's ``checkpoints/`` (it would
overwrite a checkpoint; symlinks are resolved for this check) and an existing path that is not a regular file
(a directory, a device node, a FIFO, a symlink: the atomic rename would replace the node itself) are refused
with exit 2. A chosen checkpoint whose payload cannot be loaded safely is reported and the next one is tried.
"""

from __future__ import annotations

import os
import stat
import sys
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import torch

from .. import log
from ..atomic import replace_by
from ..checkpoint import CheckpointInfo, CheckpointManager, InvalidCheckpoint, checkpoints_dir, dcp, paths
from ..checkpoint.retention import rule_of
from ..errors import ResumableError

# Wrapper prefixes on parameter names: torch.compile (``_orig_mod.``) and DistributedDataParallel (``module.``).
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class ExportError(ResumableError):
    """Nothing suitable to export, or the output cannot be written; the message says what to do."""


def checkpoint_to_export(run_dir: Path, best: bool = False) -> CheckpointInfo:
    """The newest fully verified checkpoint of ``run_dir``, or with ``best`` the valid one that is best by the run's
    metric (the newest manifest's ``best`` record: ``monitor`` and ``mode``; before runs could choose, the highest
    test_acc), ties: the newest."""
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
    ranked = _ranked(valid)
    if not ranked:
        raise ExportError(f"--best: no valid checkpoint in {run_dir} records {rule_of(valid[-1].manifest).monitor}; "
                          f"export the newest without --best")
    return ranked[0]


def _ranked(valid: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """The valid checkpoints that record the run's monitored metric, best first (ties: the newest first)."""
    rule = rule_of(valid[-1].manifest) if valid else rule_of(None)
    sign = 1.0 if rule.mode == "max" else -1.0
    scored = [(rule.value(i.metrics), i) for i in valid]
    ordered = sorted(((v, i) for v, i in scored if v is not None), key=lambda p: (sign * p[0], p[1].step), reverse=True)
    return [i for _, i in ordered]


def _candidates(run_dir: Path, best: bool) -> Iterator[CheckpointInfo]:
    """The checkpoint :func:`checkpoint_to_export` picks, then the ones to fall back on in order: older valid
    ones (newest first), or with ``best`` the next best scored ones."""
    first = checkpoint_to_export(run_dir, best)
    yield first
    manager = CheckpointManager(checkpoints_dir(run_dir))
    if best:
        yield from (i for i in _ranked([i for i in manager.inspect(deep=True) if i.valid]) if i.step != first.step)
        return
    for step, path in reversed(manager.step_dirs()):
        if step < first.step:
            info = manager.check(step, path, deep=True)
            if info.valid:
                yield info


def check_out(run_dir: Path, out: Path) -> None:
    """Refuse an ``--out`` that would damage the run or replace something that is not a regular file."""
    checkpoints = checkpoints_dir(run_dir).resolve()
    target = out.resolve()  # follows links: a link into checkpoints/ is refused as well
    if target == checkpoints or checkpoints in target.parents:
        raise ExportError(f"--out {out} is inside the run's checkpoints ({checkpoints}): writing there would damage a "
                          f"checkpoint. Give a path outside it, e.g. {Path(run_dir) / 'model.pt'}")
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise ExportError(f"--out {out} is a directory; give a file path such as {out / 'model.pt'}")
    if not stat.S_ISREG(mode):
        raise ExportError(f"--out {out} exists and is {paths.kind_of(out)}, not a regular file: export replaces only a "
                          f"regular file. Give another path (or the path of the file itself)")


def export_model(run_dir: Path, out: Path, best: bool = False) -> tuple[CheckpointInfo, Path]:
    """Write the model state_dict of the chosen checkpoint to ``out`` atomically; returns (checkpoint, out)."""
    out = Path(out)
    check_out(Path(run_dir), out)
    manager = CheckpointManager(checkpoints_dir(run_dir))
    reasons: list[str] = []
    for info in _candidates(Path(run_dir), best):
        try:
            payload = manager.load(info)
            break
        except InvalidCheckpoint as e:  # verified by sha256, still unusable (e.g. a hostile payload structure)
            log.warning(f"checkpoint {info.step} is invalid: {e}; trying the next one")
            reasons.append(f"step {info.step}: {e}")
    else:
        raise ExportError(f"no checkpoint of {run_dir} could be loaded ({'; '.join(reasons)}); see resumable inspect "
                          f"{run_dir}")
    model = payload.get("model")
    if (info.manifest or {}).get("sharded") == dcp.KIND:  # FSDP: the weights are every rank's DCP shards, gathered
        model = dcp.read_model(info.path)
    if not isinstance(model, dict) or not model:
        raise ExportError(f"{info.path} holds no model weights (payload has no 'model' state_dict)")
    state = strip_wrapper_prefixes(model)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _save_atomic(state, out)
    except OSError as e:
        raise ExportError(f"cannot write {out}: {e}") from e
    frozen = (info.manifest or {}).get("frozen") or {}
    if frozen:  # a LoRA run: the base was never stored, only fingerprinted (engine/state/frozen.py)
        log.warning(f"{len(frozen)} frozen tensor(s) of the model are not in its checkpoints (the run's script "
                    f"loads them, e.g. the base weights): {out} holds the {len(state)} trained ones. Build the "
                    f"base, then model.load_state_dict(torch.load({str(out)!r}), strict=False)")
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
    replace_by(out, lambda handle: torch.save(obj, handle))


@click.command("export", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="File to write the model state_dict to (e.g. model.pt).")
@click.option("--best", is_flag=True,
              help="Export the best valid checkpoint by the run's metric (Evaluation(monitor=, mode=); by default "
                   "the highest test_acc), not the newest.")
def export_command(run_dir: Path, out: Path, best: bool) -> None:
    """Export the model weights of RUN_DIR's newest valid checkpoint as a plain state_dict.

    Load it without resumable: model.load_state_dict(torch.load("model.pt", weights_only=True)).
    """
    try:
        info, out = export_model(run_dir, out, best)
    except ExportError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    rule = rule_of(info.manifest)
    value = rule.value(info.metrics)
    epoch = info.epoch if info.epoch is not None else "-"
    click.echo(f"exported model weights of step {info.step} (epoch {epoch}, {rule.monitor} "
               f"{f'{value:.4f}' if value is not None else '-'}) from {info.path} to {out}")
