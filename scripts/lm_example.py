"""A tiny GPT trained on bytes streamed from local text files, resumably: kill it at any moment, run it again.

What an LLM fine-tune in Colab looks like, at toy size: a GPT-style model in plain torch, byte-level windows
streamed from text files by an ``IterableDataset`` (with ``state_dict``/``load_state_dict``, so a resume seeks
straight to its position instead of replaying), AdamW with linear warmup and cosine decay, gradient clipping,
bf16 autocast, 4 micro-batches per optimizer step, a validation loss every ``--eval-every`` steps (the
checkpoint with the lowest one is kept), and optionally LoRA through ``peft`` (the frozen base is then
recorded by sha256 in checkpoints, not written). Runs offline on CPU in seconds::

    python scripts/lm_example.py --run-dir runs/lm                         # text: this project's own sources
    python scripts/lm_example.py --run-dir runs/lm-lora --lora --text 'books/*.txt' --num-workers 2
    # kill it (Ctrl-C, kill -9, a Colab timeout) and run the same command again: it ends as if never stopped
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import IterableDataset, get_worker_info

import resumable

SOURCES = str(Path(resumable.__file__).parent / "**" / "*.py")


class ByteWindows(IterableDataset):
    """Windows of ``block + 1`` bytes (input and its next-byte target) read in order from ``files``; window k
    goes to DataLoader worker ``k % num_workers``. The state is the next window this copy will read, so a
    resume seeks to it (O(1)) instead of reading its way there."""

    def __init__(self, files: list[str], block: int) -> None:
        self.files, self.block = files, block
        self.next_window = 0
        self.resume_at: int | None = None

    def state_dict(self) -> dict[str, int]:
        return {"next_window": self.next_window}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = int(state["next_window"])

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        k = self.resume_at if self.resume_at is not None else worker
        self.resume_at, self.next_window = None, k
        first = 0  # the global index of the current file's first window
        for path in self.files:
            count = max(os.path.getsize(path) - 1, 0) // self.block
            with open(path, "rb") as f:
                while k < first + count:
                    f.seek((k - first) * self.block)
                    window = torch.frombuffer(bytearray(f.read(self.block + 1)), dtype=torch.uint8).long()
                    k += workers
                    self.next_window = k
                    yield window[:-1], window[1:]
            first += count


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(attended.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, block: int, width: int = 64, layers: int = 2, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(256, width), nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 256, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def warmup_cosine(warmup: int, total: int):  # noqa: ANN201 - a LambdaLR factor
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def build(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)  # the same initial (or, with --lora, base) weights on every start
    model = TinyGPT(args.block)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                                                 target_modules=["qkv", "proj"]))
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/lm")
    parser.add_argument("--text", default=SOURCES, help="glob of text files to stream (default: resumable's sources)")
    parser.add_argument("--max-files", type=int, default=None, help="use the first N files of the glob only")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--checkpoint-steps", type=int, default=10)
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) on a frozen base")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=50,
                        help="val_loss on held-out windows every N steps; the lowest one's checkpoint is kept (0: off)")
    args = parser.parse_args(argv)

    files = sorted(glob.glob(args.text, recursive=True))[:args.max_files]
    if not files:
        parser.error(f"--text {args.text!r} matches no file: give a glob of local text files")
    model = build(args)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                                  weight_decay=0.1, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup, args.max_steps))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)

    held_out = next(iter(torch.utils.data.DataLoader(ByteWindows(files[-1:], args.block), batch_size=16)))

    def evaluate() -> dict[str, float]:  # mid-epoch too: a one-epoch run gets evaluations and a best checkpoint
        model.eval()  # resumable puts the train/eval modes (and every RNG stream) back afterwards
        x, y = (t.to(device) for t in held_out)
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            logits = model(x)
        return {"val_loss": F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item()}

    evaluation = (resumable.Evaluation(evaluate, every_steps=args.eval_every, monitor="val_loss", mode="min")
                  if args.eval_every else None)
    run = resumable.Run(args.run_dir, model=model, optimizer=optimizer, scheduler=scheduler,
                        data=ByteWindows(files, args.block), batch_size=args.batch_size, epochs=args.epochs,
                        accumulate=args.accumulate, evaluate=evaluation,
                        config={"files": len(files), "block": args.block, "lora": args.lora},
                        loader=resumable.Loader(num_workers=args.num_workers),
                        checkpointing=resumable.Checkpointing(steps=args.checkpoint_steps),
                        session=resumable.Session(max_steps=args.max_steps),
                        reporting=resumable.Reporting(log_every=args.log_every, progress=False))
    for _epoch, _step, (x, y) in run:
        x, y = x.to(device), y.to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        (loss / args.accumulate).backward()
        if run.sync_step:  # the last of the micro-batches of one optimizer step
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        run.log(loss)
    return run.exit_code


if __name__ == "__main__":
    sys.exit(main())
