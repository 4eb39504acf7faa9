"""Your own model, made resumable with resumable.Run: kill it at any moment, run it again, and it continues.

A small CNN with BatchNorm (not the MNIST guide's), a one-cycle LR schedule, and a map-style dataset whose
random augmentation runs in DataLoader workers. Data is synthetic (no download): 28x28 images whose label is
the quadrant holding a bright blob.

    python scripts/own_model_example.py --run-dir runs/own --epochs 3 --num-workers 2 --accumulate 2 --amp bf16
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

import resumable


class Blobs(Dataset):
    """``size`` images with a blob in one of 4 quadrants; random shifts and noise when ``augment``."""

    def __init__(self, size: int, seed: int, augment: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (size,), generator=g)
        self.images = torch.rand(size, 1, 28, 28, generator=g)
        for i, label in enumerate(self.labels.tolist()):
            r, c = (label // 2) * 14 + 5, (label % 2) * 14 + 5
            self.images[i, 0, r:r + 4, c:c + 4] += 0.6
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]
        if self.augment:  # random: reproduced exactly after a resume, whichever worker loads it
            shift = torch.randint(-2, 3, (2,))
            image = torch.roll(image, shifts=(int(shift[0]), int(shift[1])), dims=(1, 2))
            image = image + 0.3 * torch.randn_like(image)
        return image, self.labels[i]


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(8 * 7 * 7, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 4)
        return self.fc(self.drop(torch.flatten(x, 1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/own")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--checkpoint-steps", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (eager backend)")
    parser.add_argument("--tensorboard", action="store_true")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--amp", choices=["none", "bf16"], default="none", help="bf16 autocast for the forward pass")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train_set, test_set = Blobs(1024, seed=1, augment=True), Blobs(256, seed=2, augment=False)
    model = SmallNet()
    if args.compile:
        model = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps_per_epoch = -(-len(train_set) // 32 // args.accumulate)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=args.epochs * steps_per_epoch)

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        model.eval()
        logits = model(test_set.images)
        model.train()
        return {"test_loss": F.cross_entropy(logits, test_set.labels).item(),
                "test_acc": (logits.argmax(1) == test_set.labels).float().mean().item()}

    # --- the resumable part: a Run instead of a DataLoader and `for epoch in range(...)` ---
    run = resumable.Run(args.run_dir, model=model, optimizer=optimizer, scheduler=scheduler, data=train_set,
                        batch_size=32, epochs=args.epochs, evaluate=evaluate, accumulate=args.accumulate,
                        loader=resumable.Loader(num_workers=args.num_workers),
                        checkpointing=resumable.Checkpointing(steps=args.checkpoint_steps),
                        session=resumable.Session(max_steps=args.max_steps),
                        reporting=resumable.Reporting(tensorboard=args.tensorboard, log_every=args.log_every,
                                                      progress=False))
    for _epoch, _step, (x, y) in run:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp == "bf16"):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        (loss / args.accumulate).backward()
        if run.sync_step:  # the last micro-batch of an optimizer step
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        run.log(loss)
    return run.exit_code


if __name__ == "__main__":
    sys.exit(main())
