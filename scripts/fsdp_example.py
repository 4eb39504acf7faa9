"""Your own model, sharded over several GPUs (or CPU processes) with FSDP2, trained resumably: a small transformer
language model on synthetic tokens. Run it under torchrun; kill it whenever you like and run the same command again.

    torchrun --standalone --nproc-per-node 2 scripts/fsdp_example.py --run-dir runs/fsdp
    # on CPU: OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 scripts/fsdp_example.py --run-dir runs/fsdp

Each transformer block is its own FSDP unit (``fully_shard``), then the whole model; every rank holds 1/N of the
weights and of AdamW's state, and writes its own shards at each checkpoint (docs/torchrun.md). The number of
processes may change between sessions: the checkpoint is resharded and the data position kept by sample count.
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset

import resumable

VOCAB, CONTEXT = 256, 32


class Tokens(Dataset):
    """Synthetic token sequences with a learnable rule (each token is the previous one plus a per-sequence step)."""

    def __init__(self, size: int = 2048) -> None:
        generator = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (size, 1), generator=generator)
        step = torch.randint(1, 8, (size, 1), generator=generator)
        self.data = (start + step * torch.arange(CONTEXT + 1)) % VOCAB

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, :-1], self.data[index, 1:]


class TinyLM(torch.nn.Module):
    def __init__(self, width: int = 128, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Parameter(torch.zeros(CONTEXT, width))
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default="runs/fsdp")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--checkpoint-steps", type=int, default=10)
    options = parser.parse_args()

    kind = "cuda" if torch.cuda.is_available() else "cpu"
    place = resumable.init_distributed(kind)  # joins torchrun's job (NCCL on GPUs, gloo on CPU)
    device = torch.device(kind, place.local_rank) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every rank, before they are sharded
    model = TinyLM().to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    run = resumable.Run(options.run_dir, model=model, optimizer=optimizer, data=Tokens(), batch_size=16,
                        epochs=options.epochs, device=device,
                        checkpointing=resumable.Checkpointing(steps=options.checkpoint_steps, keep=2),
                        session=resumable.Session(max_steps=options.max_steps))
    for _epoch, _step, (tokens, targets) in run:
        logits = model(tokens.to(device))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.to(device).reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.log(loss)
    code = run.exit_code
    del run, model, optimizer  # the model's and the Run's hold on the process group goes first (docs/torchrun.md)
    gc.collect()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
