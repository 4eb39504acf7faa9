"""A GAN with two data sources, made resumable with resumable.Run: kill it at any moment, run it again, and it
continues bit-identically, both sources included.

The real samples (points on a ring of 8 Gaussians) are the Run's ``data``; the generator's latent codes come from a
second source, ``run.loader("codes", ...)``: a bank of 300 codes drawn once, shuffled in its own order, in batches
of 64 (the short rest dropped): it runs out every 4 steps and starts its next epoch, while an epoch of real data is
8 steps. Each step trains the discriminator on a real batch and a generated one, then the generator. Synthetic
data, no download.

    python scripts/gan_example.py --run-dir runs/gan --epochs 4
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import resumable

LATENT = 8


def ring(size: int, seed: int) -> TensorDataset:
    """``size`` points near the 8 corners of a ring of radius 2."""
    g = torch.Generator().manual_seed(seed)
    angle = torch.randint(0, 8, (size,), generator=g).float() * (2 * math.pi / 8)
    points = torch.stack([2 * angle.cos(), 2 * angle.sin()], 1) + 0.05 * torch.randn(size, 2, generator=g)
    return TensorDataset(points)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/gan")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--checkpoint-steps", type=int, default=None)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(LATENT, 32), nn.ReLU(), nn.Linear(32, 2))
    discriminator = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Dropout(0.1), nn.Linear(32, 1))
    model = nn.ModuleDict({"generator": generator, "discriminator": discriminator})
    d_optimizer = torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.9))
    g_optimizer = torch.optim.Adam(generator.parameters(), lr=2e-3, betas=(0.5, 0.9))
    codes = TensorDataset(torch.randn(300, LATENT, generator=torch.Generator().manual_seed(3)))

    run = resumable.Run(args.run_dir, model=model, optimizer=d_optimizer, objects={"g_optimizer": g_optimizer},
                        data=ring(512, seed=1), batch_size=64, epochs=args.epochs,
                        checkpointing=resumable.Checkpointing(steps=args.checkpoint_steps),
                        session=resumable.Session(max_steps=args.max_steps),
                        reporting=resumable.Reporting(log_every=args.log_every))
    # the second source: its position is checkpointed too
    latent = run.loader("codes", codes, batch_size=64, drop_last=True)
    ones, zeros = torch.ones(64, 1), torch.zeros(64, 1)
    for _epoch, _step, (real,) in run:
        (z,) = next(latent)
        fake = generator(z)
        d_loss = (F.binary_cross_entropy_with_logits(discriminator(real), ones)
                  + F.binary_cross_entropy_with_logits(discriminator(fake.detach()), zeros))
        d_optimizer.zero_grad()
        d_loss.backward()
        d_optimizer.step()
        g_loss = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
        g_optimizer.zero_grad()
        g_loss.backward()
        g_optimizer.step()
        run.log(d_loss + g_loss)
    return run.exit_code


if __name__ == "__main__":
    sys.exit(main())
