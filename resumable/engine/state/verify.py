"""Proof that a resume took effect: after a checkpoint is loaded, the live objects are read back and compared
with what was saved, so a resume that silently loaded nothing (an overridden ``load_state_dict``, a scheduler
that was never passed, an optimizer re-created after the Run was built) stops with an error that names the
object, instead of training on from the wrong state.

* :func:`verify_restored` (at each resume): the live model + optimizer equal, byte for byte, the payload whose
  fingerprint matched the manifest's; the data position (sampler or stream), the loop position, the scheduler's
  ``last_epoch``, the AMP scaler and every RNG stream read back equal the checkpoint's.
* :func:`unpassed_schedulers`: learning-rate schedulers attached to a checkpointed optimizer (torch marks the
  ``step`` it wraps) that are not checkpointed themselves.
* :class:`TrainingWatch` (every step of a session): the optimizers that step are the Run's, on the Run's model.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ... import log
from ...checkpoint import digests
from ...checkpoint.tree import tensors
from ...errors import ResumeNotApplied
from .train_state import capture_rng

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


def _model_and_optimizer(objects: dict[str, Any], payload: dict[str, Any]) -> str:
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
    return f"model + optimizer byte-equal to the checkpoint ({count} tensors, {size / 1e6:.1f} MB)"


_ADVICE = {
    "model": "its load_state_dict did not load the weights (is it overridden, or was the model re-created or "
             "replaced after the Run was built?)",
    "optimizer": "its load_state_dict did not load the state (was the optimizer re-created after the Run was "
                 "built? pass the optimizer you step, built before the Run)",
}


def verify_restored(objects: dict[str, Any], payload: dict[str, Any], train_state: Any, rng: dict[str, Any],
                    check_rng: bool = True, sharded: str | None = None) -> str:
    """Compare the live state with ``payload`` (just loaded); raise ResumeNotApplied naming the object that did
    not take its state, else return what was checked and how long it took.

    ``payload`` is the one whose fingerprint was just matched with the manifest's, so the live model and
    optimizer equal to it byte for byte is the same proof as their fingerprint recomputed, without hashing."""
    started = time.perf_counter()
    checked = [sharded if sharded is not None else _model_and_optimizer(objects, payload)]
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


class TrainingWatch:
    """Proof, at every optimizer step of a session, that the objects being trained are the objects the Run saves.

    A global optimizer post-step hook records which optimizers step while the loop body runs (:meth:`begin` before
    each batch is handed out, :meth:`check` once the step is done). It is an error, raised before any checkpoint of
    the stale state is committed, when

    * an optimizer the Run does not checkpoint stepped the model's parameters (it was re-created after the Run was
      built: its state would never be saved);
    * an optimizer the Run does not checkpoint stepped and none of the Run's did (a model *and* optimizer re-created
      after the Run was built, e.g. a notebook's model cell run again: the Run would commit its own untrained
      objects);
    * the Run's optimizer stepped without a gradient on any of its parameters (checked at its first step: the model
      was re-created, so the Run's optimizer holds the old one's parameters).

    A step in which no optimizer stepped (a GradScaler skipping an overflow) proves nothing and is not judged. The
    hook costs one Python call per ``optimizer.step()``."""

    def __init__(self, known: list[Any], model: torch.nn.Module) -> None:
        self.known = [o for o in known if o is not None]
        self.params = {id(p) for p in model.parameters()}
        self._stepped: list[Any] = []
        self._gradless: Any = None
        self._grads_checked = False
        self._handle = register_optimizer_step_post_hook(self._record)

    def _record(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self._stepped.append(optimizer)
        if not self._grads_checked and any(optimizer is k for k in self.known):
            self._grads_checked = True
            if not any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
                self._gradless = optimizer

    def begin(self) -> None:
        """A batch goes to the loop body: what steps from now on is its step's."""
        self._stepped.clear()

    def check(self) -> None:
        stepped, self._stepped = self._stepped, []
        if self._gradless is not None:
            self.close()
            raise ResumeNotApplied(
                f"the Run's optimizer ({type(self._gradless).__name__}) stepped, but none of its parameters had a "
                f"gradient (no backward reached them): the model that computed the loss is probably not the model the "
                f"Run was built with (was the model re-created after the Run, e.g. its notebook cell run again?), and "
                f"the Run would checkpoint the old, untrained one. Run the cell that builds the Run again (after the "
                f"model's), then the loop; nothing of this session was committed. (Step the optimizer after a "
                f"backward that reaches its parameters.)")
        strangers = [o for o in stepped if all(o is not k for k in self.known)]
        if not strangers:
            return
        kind = type(strangers[0]).__name__
        if any(id(p) in self.params for o in strangers for group in o.param_groups for p in group["params"]):
            self.close()
            raise ResumeNotApplied(f"an optimizer that this Run does not checkpoint ({kind}) stepped the model's "
                                   f"parameters: it was probably re-created after the Run was built, so it did not "
                                   f"get the checkpoint's state and its own state would never be saved. Build the "
                                   f"optimizer before the Run and pass that one (Run(optimizer=...))")
        if len(strangers) == len(stepped):
            self.close()
            raise ResumeNotApplied(f"this step was taken by an optimizer ({kind}) that the Run does not checkpoint, on "
                                   f"parameters that are not the Run's model's, and the Run's optimizer did not step: "
                                   f"the model and optimizer were re-created after the Run was built (a notebook's "
                                   f"model cell run again?), so the Run would checkpoint its own, untrained objects. "
                                   f"Run the cell that builds the Run again (after the model's), then the loop; "
                                   f"nothing of this session was committed. (A second optimizer of your own must be "
                                   f"checkpointed too: Run(objects={{'name': optimizer}}).)")

    def close(self) -> None:
        self._handle.remove()
