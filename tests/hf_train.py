"""A tiny Hugging Face Trainer run for tests/test_hf_trainer.py and scripts/bench_trainer_resume.py: GPT-2 built from
a config (2 layers, 32 wide, dropout on), a synthetic dataset of 64 token sequences, batch 4 (16 steps an epoch),
on CPU with one thread. Nothing is downloaded.

    python tests/hf_train.py OUTPUT_DIR [--max-steps 40] [--save-steps 5] [--limit N] [--time-limit 2s]
                             [--drive URL] [--no-callback] [--step-sleep S] [--pause-before-commit STEP]
                             [--result FILE]

Resumes from ``callback.latest_valid(OUTPUT_DIR)`` (``--no-callback``: from transformers' get_last_checkpoint, the
highest-numbered folder, as a plain script would) and exits with ``callback.exit_code``. ``--result`` writes the
per-step log (loss, grad norm, learning rate) and the fingerprint of the final weights as JSON.
``--pause-before-commit STEP`` prints ``SAVED-UNCOMMITTED STEP`` once the Trainer has written checkpoint-STEP and
before the callback commits it, then sleeps: a test kills it there.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

from resumable.checkpoint.format import fingerprint
from resumable.integrations.transformers import ResumableCallback

SAMPLES = 64


class Tokens(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Slow(TrainerCallback):
    """Test hooks: a pause at each step end, and a pause between the Trainer's save and the commit."""

    def __init__(self, step_sleep: float, pause_at: int | None) -> None:
        self.step_sleep = step_sleep
        self.pause_at = pause_at

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        time.sleep(self.step_sleep)

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if state.global_step == self.pause_at:
            print(f"SAVED-UNCOMMITTED {state.global_step}", flush=True)
            time.sleep(120)


def build(output_dir: str, max_steps: int, save_steps: int, limit: int | None, callbacks: list,
          eval_dataset: Dataset | None = None, **arguments) -> Trainer:  # noqa: ANN003
    """``arguments``: more TrainingArguments (eval_strategy, save_strategy...)."""
    set_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, save_steps=save_steps, logging_steps=1,
                             per_device_train_batch_size=4, learning_rate=1e-3, seed=0, report_to=[], use_cpu=True,
                             save_total_limit=limit, disable_tqdm=True, dataloader_num_workers=0, **arguments)
    return Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=eval_dataset, callbacks=callbacks)


def steps_log(trainer: Trainer) -> dict[str, dict[str, float]]:
    """The per-step training log, without timings."""
    return {str(entry["step"]): {k: entry[k] for k in ("loss", "grad_norm", "learning_rate") if k in entry}
            for entry in trainer.state.log_history if "loss" in entry}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--time-limit", default=None)
    parser.add_argument("--drive", default=None)
    parser.add_argument("--no-callback", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--pause-before-commit", type=int, default=None)
    parser.add_argument("--result", default=None)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)  # CPU float reductions depend on the thread count: the same in every run
    slow = Slow(options.step_sleep, options.pause_before_commit)
    if options.no_callback:
        trainer = build(options.output_dir, options.max_steps, options.save_steps, options.limit, [slow])
        resume = get_last_checkpoint(options.output_dir) if _exists(options.output_dir) else None
        callback = None
    else:
        callback = ResumableCallback(time_limit=options.time_limit, drive=options.drive, flush_timeout="60s")
        trainer = build(options.output_dir, options.max_steps, options.save_steps, options.limit, [slow, callback])
        resume = callback.latest_valid(options.output_dir)
    print(f"RESUME-FROM {resume}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    if options.result:
        with open(options.result, "w", encoding="utf-8") as handle:
            json.dump({"steps": steps_log(trainer), "global_step": trainer.state.global_step,
                       "fingerprint": fingerprint(trainer.model.state_dict(), None)}, handle)
    return callback.exit_code if callback is not None else 0


def _exists(path: str) -> bool:
    import os

    return os.path.isdir(path)


if __name__ == "__main__":
    sys.exit(main())
