"""A tiny Accelerate run for tests/test_accelerate.py: an MLP with dropout on 96 synthetic samples, batch 8 (12 steps
an epoch, 3 epochs), Adam and a step LR schedule, a seeded shuffle per epoch (``use_seedable_sampler`` and
``set_epoch``), on CPU with one thread. Nothing is downloaded.

    python tests/accelerate_train.py RUN_DIR [--epochs 3] [--save-every 4] [--keep 2] [--time-limit 2s]
                                     [--drive URL] [--step-sleep S] [--result FILE]

Resumes with ``ResumableState.load_state`` and ``skip`` (``accelerator.skip_first_batches``), logs each step's loss
to ``RUN_DIR/losses.jsonl`` (a step trained again after a kill is logged again) and exits with ``finish()``.
``--result`` writes the fingerprint of the final weights and optimizer as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from resumable.checkpoint.format import fingerprint
from resumable.integrations.accelerate import ResumableState


def build(**accelerator_args: object) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, object, DataLoader]:
    set_seed(0)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
                              **accelerator_args)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    data = TensorDataset(torch.randn(96, 6, generator=torch.Generator().manual_seed(1)),
                         torch.randint(0, 3, (96,), generator=torch.Generator().manual_seed(2)))
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return accelerator, model, optimizer, scheduler, loader


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--time-limit", default=None)
    parser.add_argument("--drive", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--result", default=None)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)  # CPU float reductions depend on the thread count: the same in every run
    accelerator, model, optimizer, scheduler, loader = build()
    ckpt = ResumableState(accelerator, options.run_dir, save_every=options.save_every, keep=options.keep,
                          time_limit=options.time_limit, drive=options.drive, flush_timeout="60s")
    start = ckpt.load_state()
    print(f"RESUME-FROM step {start.step}", flush=True)
    losses = Path(options.run_dir) / "losses.jsonl"
    losses.parent.mkdir(parents=True, exist_ok=True)
    step, stopped = start.step, False
    for epoch in range(start.epoch, options.epochs):
        loader.set_epoch(epoch)
        for batch, (x, y) in enumerate(ckpt.skip(loader, epoch), start=start.batch if epoch == start.epoch else 0):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            step += 1
            with losses.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
            time.sleep(options.step_sleep)
            if ckpt.step_end(step, epoch, batch + 1):
                stopped = True
                break
        if stopped:
            break
    else:
        ckpt.save_state(step, options.epochs, 0)  # the end: a re-run finds the run complete
    if options.result and not stopped:
        with open(options.result, "w", encoding="utf-8") as handle:
            json.dump({"step": step, "fingerprint": fingerprint(accelerator.unwrap_model(model).state_dict(),
                                                                optimizer.state_dict())}, handle)
    return ckpt.finish()


if __name__ == "__main__":
    sys.exit(main())
