"""Proof that a resume took effect: after a checkpoint is loaded, the live objects are read back and compared
with what was saved, so a resume that silently loaded nothing (an overridden ``load_state_dict``, a scheduler
that was never passed, an optimizer re-created after the Run was built) stops with an error that names the
object, instead of training on from the wrong state.

* :func:`verify_restored` (at each resume): the live model + optimizer equal, byte for byte, the payload whose
  fingerprint matched the manifest's; the data position (sampler or stream), the loop position, the scheduler's
  ``last_epoch``, the AMP scaler and every RNG stream read back equal the checkpoint's.
* :func:`unpassed_schedulers`: learning-rate schedulers attached to a checkpointed optimizer (torch marks the
  ``step`` it wraps) that are not checkpointed themselves.
* :class:`StepWatch` (first step of a session): the optimizer that steps the model is one the Run checkpoints.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import log
from ..checkpoint import digests
from ..checkpoint.tree import tensors
from ..errors import ResumeNotApplied
from .state import capture_rng

_REPLICATED = ("step", "epoch", "batch_in_epoch")  # TrainState fields equal on every rank


def difference(saved: Any, live: Any, path: str = "") -> str | None:
    """Where ``live`` first differs from ``saved`` (``None``: equal), comparing tensors by dtype, shape and bytes
    (so NaNs compare equal to themselves) and lists equal to tuples."""
    if isinstance(saved, torch.Tensor) or isinstance(live, torch.Tensor):
        if not (isinstance(saved, torch.Tensor) and isinstance(live, torch.Tensor)):
            return f"{path or '/'} ({type(saved).__name__} saved, {type(live).__name__} now)"
        if (saved.dtype, saved.shape) != (live.dtype, live.shape):
            return f"{path or '/'} ({saved.dtype} {tuple(saved.shape)} saved, {live.dtype} {tuple(live.shape)} now)"
        same = torch.equal(saved.detach().cpu().reshape(-1).view(torch.uint8) if saved.numel() else saved.cpu(),
                           live.detach().cpu().reshape(-1).view(torch.uint8) if live.numel() else live.cpu())
        return None if same else f"{path or '/'} (other values)"
    if isinstance(saved, dict) and isinstance(live, dict):
        if set(saved) != set(live):
            keys = sorted(map(str, set(saved) ^ set(live)))[:3]
            return f"{path or '/'} (keys {keys} are in one only)"
        return next((d for k in saved if (d := difference(saved[k], live[k], f"{path}/{k}")) is not None), None)
    if isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)):
        if len(saved) != len(live):
            return f"{path or '/'} ({len(saved)} items saved, {len(live)} now)"
        return next((d for i, (a, b) in enumerate(zip(saved, live, strict=True))
                     if (d := difference(a, b, f"{path}/{i}")) is not None), None)
    if isinstance(saved, float) and isinstance(live, float) and math.isnan(saved) and math.isnan(live):
        return None
    return None if saved == live else f"{path or '/'} ({saved!r} saved, {live!r} now)"


def _live(objects: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """The live model + optimizer state over what the checkpoint stored (frozen tensors left out)."""
    model = objects["model"].state_dict()
    saved_model = payload["model"]
    if isinstance(model, dict) and isinstance(saved_model, dict):
        model = {key: model[key] for key in saved_model if key in model}
    return {"model": model, "optimizer": objects["optimizer"].state_dict()}


_ADVICE = {
    "model": "its load_state_dict did not load the weights (is it overridden, or was the model re-created or "
             "replaced after the Run was built?)",
    "optimizer": "its load_state_dict did not load the state (was the optimizer re-created after the Run was "
                 "built? pass the optimizer you step, built before the Run)",
}


def verify_restored(objects: dict[str, Any], payload: dict[str, Any], train_state: Any, rng: dict[str, Any],
                    check_rng: bool = True) -> str:
    """Compare the live state with ``payload`` (just loaded); raise ResumeNotApplied naming the object that did
    not take its state, else return what was checked and how long it took.

    ``payload`` is the one whose fingerprint was just matched with the manifest's, so the live model and
    optimizer equal to it byte for byte is the same proof as their fingerprint recomputed, without hashing."""
    started = time.perf_counter()
    live = _live(objects, payload)
    differs = next(((name, where) for name in digests.COVERED
                    if (where := difference(payload[name], live[name], f"/{name}")) is not None), None)
    if differs is not None:
        name, where = differs
        raise ResumeNotApplied(f"resume verification failed: the {name} does not hold the checkpoint's state after "
                               f"loading it ({where} differs): {_ADVICE[name]}. Training on would start from the "
                               f"wrong state; nothing was changed on disk")
    size = sum(t.numel() * t.element_size() for _, t in tensors(live))
    count = sum(1 for _ in tensors(live))
    checked = [f"model + optimizer byte-equal to the checkpoint ({count} tensors, {size / 1e6:.1f} MB)"]
    for name, obj in objects.items():
        if name in digests.COVERED or obj is None or name not in ("sampler", "scheduler", "scaler"):
            continue
        saved, now = payload[name], obj.state_dict()
        if name == "scheduler" and isinstance(saved, dict) and "last_epoch" in saved:
            saved, now = saved["last_epoch"], now.get("last_epoch")
        if name == "sampler" and getattr(obj, "allow_size_change", False) and isinstance(saved, dict):
            saved, now = ({k: v for k, v in d.items() if k != "num_samples"} for d in (saved, now))  # changed: allowed
        where = difference(saved, now)
        if where is not None:
            what = {"sampler": "data position", "scheduler": "scheduler's last_epoch", "scaler": "AMP scaler"}[name]
            raise ResumeNotApplied(f"resume verification failed: the {what} read back differs from the checkpoint "
                                   f"({where}): the {name}'s load_state_dict did not take its state; fix it (or pass "
                                   f"the object that is used in training), then resume again")
        position = f"data position (epoch {train_state.epoch}, batch {train_state.batch_in_epoch})"
        checked.append({"sampler": position, "scheduler": f"scheduler last_epoch {now}",
                        "scaler": "AMP scaler"}[name])
    where = difference({k: payload["train_state"][k] for k in _REPLICATED},
                       {k: getattr(train_state, k) for k in _REPLICATED})
    if where is not None:
        raise ResumeNotApplied(f"resume verification failed: the loop position read back differs ({where})")
    if check_rng:
        now = capture_rng()
        streams = ["python", "numpy", "torch_cpu"]
        count = min(len(rng.get("cuda", [])), len(now["cuda"]))
        where = difference({k: rng[k] for k in streams} | {"cuda": rng.get("cuda", [])[:count]},
                           {k: now[k] for k in streams} | {"cuda": now["cuda"][:count]})
        if where is not None:
            raise ResumeNotApplied(f"resume verification failed: the RNG streams read back differ from the "
                                   f"checkpoint's ({where}); the resumed run would not repeat the uninterrupted one")
        checked.append("RNG streams (python, numpy, torch" + (f", {count} CUDA" if count else "") + ")")
    return f"in {time.perf_counter() - started:.3f}s: {', '.join(checked)}"


def unpassed_schedulers(objects: dict[str, Any]) -> list[str]:
    """Names of checkpointed optimizers that a learning-rate scheduler wraps (torch marks the ``step`` it
    patches) while no checkpointed object is a scheduler of that optimizer."""
    schedulers = [o for o in objects.values() if hasattr(o, "last_epoch") and hasattr(o, "optimizer")]
    wrapped = [(name, o) for name, o in objects.items()
               if hasattr(o, "param_groups") and hasattr(getattr(o, "step", None), "_wrapped_by_lr_sched")]
    return [name for name, o in wrapped if not any(s.optimizer is o for s in schedulers)]


def check_schedulers(objects: dict[str, Any], resuming: bool) -> None:
    """A scheduler that was not passed loses its position at a resume: an error then, a warning at a fresh start."""
    unpassed = unpassed_schedulers(objects)
    if unpassed and resuming:
        raise ResumeNotApplied(f"a learning-rate scheduler steps {unpassed[0]!r} but was not passed to the Run: its "
                               f"position (last_epoch) is not in the checkpoint, so the learning rate would restart "
                               f"from its first value. Pass it: Run(scheduler=...)")
    if unpassed:
        log.warning(f"a learning-rate scheduler steps {unpassed[0]!r} but was not passed to the Run: a resume would "
                    f"restart its schedule. Pass it: Run(scheduler=...)")


class StepWatch:
    """Records which optimizers step during the first optimizer step of a session (a global post-step hook,
    removed by :meth:`check`); one that moves the model's parameters but is not checkpointed is an error."""

    def __init__(self, known: list[Any], model: torch.nn.Module) -> None:
        self.known = [o for o in known if o is not None]
        self.params = {id(p) for p in model.parameters()}
        self.strangers: list[Any] = []
        self._handle = register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if all(optimizer is not k for k in self.known) and any(
                id(p) in self.params for group in optimizer.param_groups for p in group["params"]):
            self.strangers.append(optimizer)

    def check(self) -> None:
        self.close()
        if self.strangers:
            kind = type(self.strangers[0]).__name__
            raise ResumeNotApplied(f"an optimizer that this Run does not checkpoint ({kind}) stepped the model's "
                                   f"parameters: it was probably re-created after the Run was built, so it did not "
                                   f"get the checkpoint's state and its own state would never be saved. Build the "
                                   f"optimizer before the Run and pass that one (Run(optimizer=...))")

    def close(self) -> None:
        self._handle.remove()
