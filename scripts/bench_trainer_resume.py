"""How far a killed-and-resumed Hugging Face Trainer run is from an uninterrupted one, with and without
ResumableCallback, and what the callback costs at start-up and per save (issue #18).

A tiny GPT-2 from a config (dropout on) on synthetic tokens, CPU, one thread; nothing is downloaded. The
uninterrupted run trains ``--steps`` steps (16 an epoch) and saves every 4. A kill after checkpoint-K is replayed
by a fresh Trainer (a new model object, its own init) in a folder holding only what the kill left: checkpoint-K,
plus, for the "killed during a save" rows, a half-written checkpoint-(K+4) (the model file only, no manifest).
It resumes from ``callback.latest_valid`` (with) or transformers' ``get_last_checkpoint`` (without) and trains to
the end; its per-step log (loss, grad norm, learning rate from ``trainer.state.log_history``) and final weights
(sha256 of every tensor) are compared with the uninterrupted run's.

Costs, median of ``--runs``: finding the checkpoint to resume (``latest_valid``, which reads every file's sha256,
against ``get_last_checkpoint``, which lists names) and the commit after each save (hash + fsync + manifest)
against the Trainer's own save.

    python scripts/bench_trainer_resume.py                 # 40 steps, width 32, 5 runs
    python scripts/bench_trainer_resume.py --width 256 --runs 3
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from resumable.checkpoint.format import fingerprint
from resumable.integrations import hf_checkpoints as hf
from resumable.integrations.transformers import ResumableCallback, latest_valid

SAVE_EVERY = 4


class Tokens(Dataset):
    def __len__(self) -> int:
        return 64  # 16 steps an epoch at batch 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class SaveTimer(TrainerCallback):
    """Placed first: on_step_end (before the save) to on_save (after it, before the commit)."""

    def __init__(self) -> None:
        self.began = 0.0
        self.saves: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.began = time.perf_counter()

    def on_save(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        self.saves.append(time.perf_counter() - self.began)


def build(output_dir: Path, steps: int, width: int, accumulate: int, init_seed: int, callbacks: list) -> Trainer:
    set_seed(init_seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=width, n_head=2, vocab_size=100, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=str(output_dir), max_steps=steps, save_steps=SAVE_EVERY, logging_steps=1,
                             per_device_train_batch_size=4 // accumulate, gradient_accumulation_steps=accumulate,
                             learning_rate=1e-3, seed=0, report_to=[], use_cpu=True, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


def outcome(trainer: Trainer) -> tuple[dict, str]:
    steps = {e["step"]: (e["loss"], e.get("grad_norm"), e.get("learning_rate"))
             for e in trainer.state.log_history if "loss" in e}
    return steps, fingerprint(trainer.model.state_dict(), None)


def compare(reference: tuple[dict, str], got: tuple[dict, str]) -> str:
    differing = [step for step in sorted(reference[0]) if reference[0][step] != got[0].get(step)]
    if differing:
        step, weights = differing[0], "identical" if reference[1] == got[1] else "differ"
        return (f"log differs at step{'s' if len(differing) > 1 else ''} {', '.join(map(str, differing))} (loss "
                f"{got[0].get(step, (None,))[0]} vs {reference[0][step][0]}); final weights {weights}")
    return "identical" if reference[1] == got[1] else "same log, final weights differ"


def replay(ref_dir: Path, scratch: Path, k: int, half_written: bool, with_callback: bool, options) -> str:  # noqa: ANN001
    out = scratch / f"k{k}-{half_written}-{with_callback}"
    out.mkdir()
    shutil.copytree(ref_dir / f"checkpoint-{k}", out / f"checkpoint-{k}")
    after = f"checkpoint-{k + SAVE_EVERY}"
    if half_written and (ref_dir / after).is_dir():
        (out / after).mkdir()
        shutil.copy(ref_dir / after / "model.safetensors", out / after)
    callbacks = [ResumableCallback()] if with_callback else []
    trainer = build(out, options.steps, options.width, options.accumulate, 1234, callbacks)
    try:
        resume = callbacks[0].latest_valid(out) if with_callback else get_last_checkpoint(str(out))
        trainer.train(resume_from_checkpoint=resume)
    except Exception as e:  # noqa: BLE001 - the row says how a plain resume fails
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0].replace(str(out) + '/', '')[:80]}"
    return compare(options.reference, outcome(trainer))


class StopAt(TrainerCallback):
    """What the callback does on SIGTERM or a spent budget: save and stop at this step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        if state.global_step == self.step:
            control.should_save = control.should_training_stop = True


def off_grid(scratch: Path, options) -> str:  # noqa: ANN001
    """Stopped (a signal, the budget) at step 7 with logging_steps 4, resumed: compared with an uninterrupted run
    logging every 4 steps."""
    runs = []
    for name, stop in (("grid-reference", None), ("grid-stopped", 7)):
        trainer = build(scratch / name, options.steps, options.width, options.accumulate, 0,
                        [StopAt(stop), ResumableCallback()] if stop else [])
        trainer.args.logging_steps = 4
        trainer.train()
        runs.append(trainer)
    callback = ResumableCallback()
    resumed = build(scratch / "grid-stopped", options.steps, options.width, options.accumulate, 1234, [callback])
    resumed.args.logging_steps = 4
    resumed.train(resume_from_checkpoint=callback.latest_valid(scratch / "grid-stopped"))
    return compare(outcome(runs[0]), outcome(resumed))


def costs(ref_dir: Path, scratch: Path, options) -> None:  # noqa: ANN001
    """Median start-up and per-save cost of the callback."""
    folder = scratch / "costs"
    for k in (options.steps - SAVE_EVERY, options.steps):
        shutil.copytree(ref_dir / f"checkpoint-{k}", folder / f"checkpoint-{k}")
    find, plain, commit = [], [], []
    for _ in range(options.runs):
        began = time.perf_counter()
        get_last_checkpoint(str(folder))
        plain.append(time.perf_counter() - began)
        began = time.perf_counter()
        latest_valid(folder)
        find.append(time.perf_counter() - began)
        store = hf.checkpoints(folder)
        store.invalidate(options.steps)
        began = time.perf_counter()
        store.adopt(options.steps, {})
        commit.append(time.perf_counter() - began)
    size = sum(p.stat().st_size for p in (folder / f"checkpoint-{options.steps}").iterdir())
    save = statistics.median(options.save_s)
    print(f"\ncheckpoint size {size / 1e6:.2f} MB; median of {options.runs} runs:")
    print(f"  choose the checkpoint to resume: latest_valid {statistics.median(find) * 1e3:.1f} ms (sha256 of "
          f"every file of the newest) vs get_last_checkpoint {statistics.median(plain) * 1e3:.2f} ms "
          f"(+{(statistics.median(find) - statistics.median(plain)) * 1e3:.1f} ms at start-up)")
    print(f"  per save: commit {statistics.median(commit) * 1e3:.1f} ms (hash, fsync, manifest) on top of the "
          f"Trainer's save {save * 1e3:.1f} ms (+{statistics.median(commit) / save:.0%})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=32, help="GPT-2 n_embd (32: a 0.4 MB checkpoint)")
    parser.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps (batch stays 4)")
    parser.add_argument("--runs", type=int, default=5)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("resumable").setLevel(logging.ERROR)  # the skip messages would interleave the table
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        scratch = Path(tmp)
        timer = SaveTimer()
        reference = build(scratch / "reference", options.steps, options.width, options.accumulate, 0,
                          [timer, ResumableCallback()])
        reference.train()
        options.reference, options.save_s = outcome(reference), timer.saves
        print(f"uninterrupted: {options.steps} steps, 16 an epoch, checkpoint every {SAVE_EVERY}, dropout 0.1, "
              f"gradient accumulation {options.accumulate}")
        print(f"{'killed after':<36}{'with ResumableCallback':<24}without (get_last_checkpoint)")
        for k in (4, 16, 20, 36):
            for half in (False, True):
                label = f"checkpoint-{k}" + (f" + half checkpoint-{k + SAVE_EVERY}" if half else "")
                row = [replay(scratch / "reference", scratch, k, half, flag, options) for flag in (True, False)]
                print(f"{label:<36}{row[0]:<24}{row[1]}")
        print(f"{'stopped at 7, logging_steps 4':<36}{off_grid(scratch, options)}")
        costs(scratch / "reference", scratch, options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
