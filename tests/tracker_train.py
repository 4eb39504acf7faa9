"""A tiny training script for tests/test_trackers.py: a small MLP through ``resumable.Run`` with an MLflow or trackio
tracker (``none``: the same training, untracked), evaluated every 3 steps (a step's training and evaluation records
are one tracker row), checkpointed every 4 steps. ``--loss-scale 2`` changes the computation (an inexact resume)."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import resumable


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--tracker", choices=("mlflow", "trackio", "none"), required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--loss-scale", type=float, default=1.0)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2))
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=generator),
                                          torch.randint(0, 2, (64,), generator=generator))
    x_val, y_val = torch.randn(16, 4, generator=generator), torch.randint(0, 2, (16,), generator=generator)

    def evaluate() -> dict[str, float]:
        with torch.no_grad():
            return {"val_loss": float(F.cross_entropy(model(x_val), y_val))}

    # MLflow chosen by tracker=, trackio by its Reporting field: both ways in
    tracker = "mlflow" if args.tracker == "mlflow" else None
    reporting = resumable.Reporting(progress=False, log_every=1,
                                    trackio="tests" if args.tracker == "trackio" else None)
    run = resumable.Run(args.run_dir, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data,
                        batch_size=8, epochs=args.epochs, tracker=tracker,
                        evaluate=resumable.Evaluation(evaluate, every_steps=3, monitor="val_loss", mode="min"),
                        checkpointing=resumable.Checkpointing(steps=4),
                        session=resumable.Session(max_steps=args.max_steps), reporting=reporting)
    for _epoch, _step, (x, y) in run:
        loss = F.cross_entropy(model(x), y) * args.loss_scale
        run.optimizer.zero_grad()
        loss.backward()
        run.optimizer.step()
        run.log(loss)
    return run.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
