"""The resumable epoch/step loop. Task code supplies a train step and an end-of-epoch hook; the loop
owns the position in the data, the checkpoint triggers, metrics and progress."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .metrics import MetricsLog
from .sampler import ResumableSampler
from .session import Session


@dataclass(frozen=True)
class LoopPlan:
    epochs: int
    max_steps: int | None = None
    checkpoint_steps: int | None = None
    log_every: int = 10
    progress: bool = True


class Loop:
    """Runs training from ``session.state`` to the end of the plan, checkpointing on the way.

    ``train_step(indices)`` trains one batch and returns its loss tensor (not synced).
    ``end_epoch(epoch)`` evaluates and returns metrics such as ``test_loss`` and ``test_acc``.
    ``current_lr()`` is logged with each training record.
    """

    def __init__(self, session: Session, sampler: ResumableSampler, plan: LoopPlan, metrics: MetricsLog,
                 train_step: Callable[[torch.Tensor], torch.Tensor],
                 end_epoch: Callable[[int], dict[str, float]],
                 current_lr: Callable[[], float], device: torch.device) -> None:
        self.session = session
        self.state = session.state
        self.sampler = sampler
        self.plan = plan
        self.metrics = metrics
        self.train_step = train_step
        self.end_epoch = end_epoch
        self.current_lr = current_lr
        self.device = device
        self._clock = time.monotonic()

    # -- plan --------------------------------------------------------------------------------------
    @property
    def total_steps(self) -> int:
        planned = self.plan.epochs * self.sampler.batches_per_epoch
        return planned if self.plan.max_steps is None else min(planned, self.plan.max_steps)

    def finished(self) -> bool:
        return self.state.epoch >= self.plan.epochs or (
            self.plan.max_steps is not None and self.state.step >= self.plan.max_steps)

    # -- loop --------------------------------------------------------------------------------------
    def run(self) -> None:
        self._clock = time.monotonic()
        while not self.finished():
            if self.state.batch_in_epoch < self.sampler.batches_per_epoch:
                self._train_epoch()
            if self.state.batch_in_epoch >= self.sampler.batches_per_epoch:
                self._finish_epoch()
        if self.session.last_saved_step != self.state.step:
            self._save("final")
        self.metrics.sync()

    def _train_epoch(self) -> None:
        state, plan, sampler = self.state, self.plan, self.sampler
        batches = sampler.batches_per_epoch
        order = sampler.epoch_order(state.epoch).to(self.device)
        # Summed on the device in float64 and synced only when needed; starting from the saved exact
        # value makes the epoch loss of a resumed run equal to an uninterrupted one.
        loss_sum = torch.tensor(state.epoch_loss_sum, dtype=torch.float64, device=self.device)
        bar = tqdm(total=batches, initial=state.batch_in_epoch, desc=f"epoch {state.epoch + 1}/{plan.epochs}",
                   unit="batch", disable=not plan.progress, file=sys.stderr, dynamic_ncols=True, leave=False)
        bar_clock, bar_samples = time.monotonic(), 0
        try:
            for index in range(state.batch_in_epoch, batches):
                indices = sampler.batch(order, index)
                loss = self.train_step(indices)
                loss_sum += loss.detach().double()
                state.step += 1
                state.batch_in_epoch = index + 1
                state.samples_seen += len(indices)
                state.epoch_loss_count += 1
                bar_samples += len(indices)
                bar.update(1)
                if state.step % plan.log_every == 0:
                    value = loss.item()
                    now = time.monotonic()
                    rate = bar_samples / max(now - bar_clock, 1e-9)
                    self.metrics.log({"step": state.step, "epoch": state.epoch + 1, "loss": value,
                                      "lr": self.current_lr(), "samples_per_s": round(rate, 1),
                                      "time": time.time()})
                    bar.set_postfix(loss=f"{value:.4f}", samples_s=f"{rate:,.0f}")
                if plan.max_steps is not None and state.step >= plan.max_steps:
                    break
                # A trigger on the last batch is left to the end-of-epoch save right after it.
                if plan.checkpoint_steps and state.step % plan.checkpoint_steps == 0 and index + 1 < batches:
                    state.epoch_loss_sum = loss_sum.item()
                    self._save("steps")
        finally:
            bar.close()
        state.epoch_loss_sum = loss_sum.item()

    def _finish_epoch(self) -> None:
        state = self.state
        results = self.end_epoch(state.epoch)
        train_loss = state.epoch_loss_sum / max(state.epoch_loss_count, 1)
        self._tick()
        record = {"step": state.step, "epoch": state.epoch + 1, "train_loss": train_loss, **results,
                  "elapsed_s": round(state.elapsed_s, 3), "time": time.time()}
        self.metrics.log(record)
        acc = results.get("test_acc")
        if acc is not None and (state.best_test_acc is None or acc > state.best_test_acc):
            state.best_test_acc, state.best_step = acc, state.step
        summary = (f"epoch {state.epoch + 1}/{self.plan.epochs}  step {state.step}  train_loss {train_loss:.4f}"
                   + "".join(f"  {k} {v:.4f}" for k, v in results.items())
                   + f"  elapsed {state.elapsed_s:.1f}s")
        tqdm.write(summary, file=sys.stderr)
        state.epoch += 1
        state.batch_in_epoch = 0
        state.epoch_loss_sum = 0.0
        state.epoch_loss_count = 0
        self._save("epoch", metrics=results)

    def _tick(self) -> None:
        now = time.monotonic()
        self.state.elapsed_s += now - self._clock
        self._clock = now

    def _save(self, reason: str, metrics: dict[str, float] | None = None) -> None:
        self._tick()
        self.session.save(reason, metrics)
