"""A small training script on a map-style dataset ordered by a sampler of the user's own (``Loader(sampler=...)`` or
``Loader(batch_sampler=...)``), for tests/test_user_sampler.py: variable-length samples padded by a collate_fn.

    python tests/sampler_train.py RUN_DIR KIND WORKERS [MAX_STEPS]

KIND: ``weighted`` (torch's WeightedRandomSampler with a generator: seeded per epoch), ``bucketed`` (a batch sampler
grouping samples of one length into batches of varying size, shuffled by its generator: seeded per epoch),
``stateful`` (a torchdata-style sampler with state_dict/load_state_dict), ``replayed`` (a sampler whose order
depends on the epochs it made before and on the global torch RNG: resumed by replay), ``unseeded`` (one drawing from
a generator seeded from the OS: not reproducible, which the first batch after a resume must catch).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from helpers import policies
from stream_train import SAMPLES, MapStyle, Model, pad, train
from torch.utils.data import Sampler, WeightedRandomSampler

import resumable


def length(i: int) -> int:
    return 2 + i % 5  # stream_train.sample's


class Bucketed(Sampler[list[int]]):
    """Batches of samples of one length, ``tokens // length`` of them (so short samples come in larger batches),
    shuffled within each length and across batches by ``generator``."""

    def __init__(self, lengths: list[int], tokens: int, generator: torch.Generator) -> None:
        self.buckets = [torch.tensor([i for i, n in enumerate(lengths) if n == size]) for size in sorted(set(lengths))]
        self.sizes = [max(1, tokens // size) for size in sorted(set(lengths))]
        self.generator = generator

    def __len__(self) -> int:
        return sum(-(-len(b) // s) for b, s in zip(self.buckets, self.sizes, strict=True))

    def __iter__(self):
        batches = []
        for members, size in zip(self.buckets, self.sizes, strict=True):
            batches += members[torch.randperm(len(members), generator=self.generator)].split(size)
        for k in torch.randperm(len(batches), generator=self.generator).tolist():
            yield batches[k].tolist()


class StatefulShuffle(Sampler[int]):
    """torchdata's protocol: a shuffle by its own generator, whose state is its position."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.rng = torch.Generator().manual_seed(7)
        self.epochs = 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        self.epochs += 1
        yield from torch.randperm(self.size, generator=self.rng).roll(self.epochs).tolist()

    def state_dict(self) -> dict:
        return {"rng": self.rng.get_state(), "epochs": self.epochs}

    def load_state_dict(self, state: dict) -> None:
        self.rng.set_state(state["rng"])
        self.epochs = state["epochs"]


class Drifting(Sampler[int]):
    """No state_dict, set_epoch or generator: its order depends on how many epochs it made and on the global torch
    RNG, so only a replay from the run's start makes an epoch again."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.seen = 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        self.seen += 1
        yield from torch.randperm(self.size).roll(self.seen).tolist()


class Unseeded(Drifting):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.rng = torch.Generator()
        self.rng.seed()  # from the OS: another order in every process

    def __iter__(self):
        yield from torch.randperm(self.size, generator=self.rng).tolist()


def order(kind: str) -> dict:
    """The Loader's sampler or batch_sampler of ``kind``."""
    if kind == "weighted":
        weights = torch.tensor([1.0 + (i % 3) for i in range(SAMPLES)])
        return {"sampler": WeightedRandomSampler(weights, SAMPLES, generator=torch.Generator())}
    if kind == "bucketed":
        return {"batch_sampler": Bucketed([length(i) for i in range(SAMPLES)], 24, torch.Generator())}
    return {"sampler": {"stateful": StatefulShuffle, "replayed": Drifting, "unseeded": Unseeded}[kind](SAMPLES)}


def main(argv: list[str]) -> int:
    run_dir, kind, workers = Path(argv[0]), argv[1], int(argv[2])
    max_steps = int(argv[3]) if len(argv) > 3 else None
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.9)
    options = {"persistent_workers": True} if workers else {}
    run = resumable.Run(run_dir, model=model, optimizer=optimizer, scheduler=scheduler, data=MapStyle(), batch_size=8,
                        epochs=2, **policies(checkpoint_steps=3, log_every=1, max_steps=max_steps, progress=False,
                                             sync_checkpoints=True, num_workers=workers, collate_fn=pad,
                                             loader_options=options, **order(kind)))
    return train(run, model, optimizer, scheduler)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
