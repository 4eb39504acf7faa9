"""A small training script that evaluates every 5 steps and at each epoch's end and keeps the checkpoint with the
lowest ``val_loss``, for tests/test_evaluation.py. Its evaluation disturbs everything it can (eval mode left on, noise
drawn from torch, ``random`` and NumPy): the Run must make it invisible to training.

    python tests/eval_train.py RUN_DIR [EVERY_STEPS]    (EVERY_STEPS 0: no evaluation at all)
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import resumable
from resumable import Checkpointing, Evaluation, Reporting, Session

SAMPLES, BATCH, EPOCHS = 240, 8, 2  # 30 steps an epoch


def data(seed: int, n: int, flipped: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, ((x.sum(1) > 0) ^ flipped).long())


def build(run_dir: Path, every: int | None) -> tuple[resumable.Run, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    held_out = data(1, 32, flipped=True)  # a set the model gets worse at: the lowest val_loss is an early one

    def evaluate() -> dict[str, float]:
        model.eval()  # left in eval mode on purpose: the Run restores the modes
        noise = 0.01 * torch.randn(()).item() + 0.0 * random.random() + 0.0 * float(np.random.rand())
        with torch.no_grad():
            x, y = held_out.tensors
            logits = model(x)
            return {"val_loss": F.cross_entropy(logits, y).item() + noise,
                    "val_acc": (logits.argmax(1) == y).float().mean().item()}

    evaluation = Evaluation(evaluate, every_steps=every, monitor="val_loss", mode="min") if every else None
    run = resumable.Run(run_dir, model=model, optimizer=optimizer, data=data(0, SAMPLES), batch_size=BATCH,
                        epochs=EPOCHS, evaluate=evaluation,
                        checkpointing=Checkpointing(every=None, steps=3, keep=1, keep_best=True),
                        session=Session(hang_timeout="off"), reporting=Reporting(progress=False, log_every=1))
    return run, model


def main(argv: list[str]) -> int:
    run, model = build(Path(argv[0]), int(argv[1]) if len(argv) > 1 else 5)
    for _epoch, _step, (x, y) in run:
        loss = F.cross_entropy(model(x), y)
        run.optimizer.zero_grad()
        loss.backward()
        run.optimizer.step()
        run.log(loss)
    return run.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
