"""A small training script on iterable data, for tests/test_stream.py: each kind of stream with dict batches of
variable-length samples (padded by a custom collate_fn) and random noise drawn while iterating.

    python tests/stream_train.py RUN_DIR KIND WORKERS [MAX_STEPS]

KIND: ``plain`` (an IterableDataset without state_dict: resumed by replay), ``stateful`` (with the protocol),
``hf`` (a Hugging Face ``datasets`` streaming dataset over local JSON-lines files made in RUN_DIR's parent),
``hfshuffle`` (the same, shuffled through a buffer),
``loader`` (torchdata's StatefulDataLoader over a map-style dataset, shuffled).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from helpers import policies
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import resumable

SAMPLES = 120


def sample(i: int, noise: bool = True) -> dict[str, torch.Tensor]:
    length = 2 + i % 5
    x = torch.full((length, 3), float(i % 3)) + torch.arange(length * 3.0).view(length, 3) / 10
    if noise:  # random while iterating: seeded per batch by resumable, so a resumed batch draws the same
        x = x + 0.1 * torch.randn(length, 3)
    return {"x": x, "y": torch.tensor(i % 3)}


def pad(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    longest = max(len(item["x"]) for item in items)
    x = torch.zeros(len(items), longest, 3)
    mask = torch.zeros(len(items), longest)
    for row, item in enumerate(items):
        x[row, :len(item["x"])] = item["x"]
        mask[row, :len(item["x"])] = 1
    return {"x": x, "mask": mask, "y": torch.stack([item["y"] for item in items])}


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class Plain(IterableDataset):
    """Each DataLoader worker takes every num_workers-th sample."""

    def __init__(self, size: int = SAMPLES) -> None:
        self.size = size
        self.pos = 0
        self.resume_at: int | None = None

    def __iter__(self):
        worker, workers = _worker()
        self.pos = self.resume_at if self.resume_at is not None else worker
        self.resume_at = None
        while self.pos < self.size:
            i, self.pos = self.pos, self.pos + workers
            yield sample(i)


class Stateful(Plain):
    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = state["pos"]


class MapStyle(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return sample(i, noise=False)


def hf_stream(folder: Path):
    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for shard in range(4):
        path = folder / f"part-{shard}.jsonl"
        rows = [sample(i, noise=False) for i in range(shard, SAMPLES, 4)]
        path.write_text("".join(json.dumps({"x": r["x"].tolist(), "y": int(r["y"])}) + "\n" for r in rows))
        files.append(str(path))
    return datasets.load_dataset("json", data_files=files, split="train", streaming=True).with_format("torch")


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(3, 16)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x)) * mask.unsqueeze(-1)
        return self.head(self.drop(h.sum(1) / mask.sum(1, keepdim=True)))


def main(argv: list[str]) -> int:
    run_dir, kind, workers = Path(argv[0]), argv[1], int(argv[2])
    max_steps = int(argv[3]) if len(argv) > 3 else None
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, 0.9)
    options = {"num_workers": workers, "collate_fn": pad}
    if kind == "loader":
        from torchdata.stateful_dataloader import StatefulDataLoader

        data = StatefulDataLoader(MapStyle(), batch_size=8, shuffle=True, num_workers=workers, collate_fn=pad,
                                  generator=torch.Generator().manual_seed(5))
        options = {}
    elif kind == "hf":
        data = hf_stream(run_dir.parent / "hf-data")
    elif kind == "hfshuffle":  # the usual LM setup: its state_dict() leaves the shuffle buffer out
        data = hf_stream(run_dir.parent / "hf-data").shuffle(seed=3, buffer_size=32)
    else:
        data = {"plain": Plain, "stateful": Stateful}[kind]()
    run = resumable.Run(run_dir, model=model, optimizer=optimizer, scheduler=scheduler, data=data, batch_size=8,
                        epochs=2, **policies(checkpoint_steps=3, log_every=1, max_steps=max_steps, progress=False,
                                             sync_checkpoints=True, **options))  # synchronous: a kill's step is exact
    return train(run, model, optimizer, scheduler)


def train(run: resumable.Run, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> int:
    """The loop of this script and tests/sampler_train.py: one optimizer and scheduler step per padded batch."""
    for _epoch, _step, batch in run:
        loss = F.cross_entropy(model(batch["x"], batch["mask"]), batch["y"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        run.log(loss)
    return run.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
