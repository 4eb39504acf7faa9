"""Checkpoints of multi-GB states: host memory, training-thread blocked time, bytes written (issue #11).

Synthetic states, built in memory (no download): a model whose weights plus Adam moments are ``--sizes`` GB, and a
LoRA-style model (``--lora-frozen-gb`` frozen base, ``--lora-trainable-mb`` trainable adapters with Adam). Every
figure is measured in this process against a baseline run here too, and printed with its ratio:

* peak resident memory during a save, above what the process held before it (the training state itself): goal
  at most the staging budget + 10%;
* training-thread blocked time per save against ``torch.save`` + fsync of the same state: goal at most 10% with a
  staging budget at least the state, and reported with a budget of 25% of the state;
* bytes a LoRA checkpoint writes against a full-model checkpoint of the same model (format 2, ``state.pt``):
  goal at most 2%;
* bytes written, and uploaded to a mirror, by a second save of an unchanged state against the first: goal at
  most 1%.

    python scripts/bench_big_state.py                   # 1 GB and 4 GB states, the LoRA state, 3 repeats
    python scripts/bench_big_state.py --sizes 1 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from resumable.checkpoint import CheckpointManager
from resumable.checkpoint import format as fmt
from resumable.checkpoint.memory import PeakMemory, peak, reset_peak, rss
from resumable.checkpoint.sharded import ShardedFormat
from resumable.checkpoint.writer import CheckpointWriter
from resumable.engine.state.keeper import StateKeeper
from resumable.engine.state.train_state import TrainState

GB = 1 << 30
MB = 1 << 20
WIDTH = 4096  # each layer is WIDTH x WIDTH float32 (64 MB)


def adam_model(state_bytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear layers whose weights plus Adam's two moments are ``state_bytes``, after one optimizer step."""
    layer_bytes = WIDTH * WIDTH * 4 * 3
    layers = max(1, round(state_bytes / layer_bytes))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    _step(model, optimizer)
    return model, optimizer


def lora_model(frozen_bytes: int, trainable_bytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A frozen base of ``frozen_bytes`` and low-rank adapters trained with Adam, whose weights and Adam moments
    together are ``trainable_bytes``."""
    layers = max(1, round(frozen_bytes / (WIDTH * WIDTH * 4)))
    rank = max(1, trainable_bytes // (3 * layers * 2 * WIDTH * 4))
    model = torch.nn.Module()
    model.base = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))
    model.base.requires_grad_(False)
    model.lora_a = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(rank, WIDTH) * 0.01) for _ in range(layers))
    model.lora_b = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(WIDTH, rank)) for _ in range(layers))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _step(model, optimizer)
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def perturb(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Change every trained tensor, as a training step does (so no shard is unchanged)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1e-4)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim():
                    value.add_(1e-6)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, trained_only: bool = False) -> int:
    tensors = [t for n, t in model.state_dict(keep_vars=True).items() if not trained_only or t.requires_grad]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def baseline_save(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[float, int]:
    """torch.save + fsync of the same state (format 2's single state.pt): (seconds, bytes)."""
    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    entry = fmt.write_payload(directory, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    return time.perf_counter() - started, entry["size"]


def keeper(root: Path, model, optimizer, budget: int | None, shard_size: int,  # noqa: ANN001
                 asynchronous: bool = True) -> StateKeeper:
    return StateKeeper(CheckpointManager(root, ShardedFormat(shard_size)), {"model": model, "optimizer": optimizer},
                        TrainState(), meta={}, keep=2, keep_best=False,
                        writer=CheckpointWriter(asynchronous=asynchronous), staging_memory=budget)


def timed_save(saver: StateKeeper, step: int) -> tuple[float, int | None, float]:
    """(training-thread blocked seconds, peak resident bytes above the start, seconds until committed)."""
    gc.collect()
    exact = reset_peak()
    before = rss()
    saver.state.step = step
    started = time.perf_counter()
    saver.save("bench")
    blocked = time.perf_counter() - started
    saver.writer.wait()
    total = time.perf_counter() - started
    top = peak() if exact else None
    return blocked, (top - before if top is not None and before is not None else None), total


def bench_restore(saver: StateKeeper, model, optimizer, root: Path) -> str:  # noqa: ANN001
    """Restore the newest checkpoint into the live objects, against torch.load of a state.pt + load_state_dict."""
    info = saver.manager.latest_valid()[0]
    gc.collect()
    saver.restore(info)
    cost = saver.restore_cost
    _, _ = baseline_save(root / "restore-baseline", model, optimizer)
    gc.collect()
    with PeakMemory() as base:
        state = torch.load(root / "restore-baseline" / fmt.PAYLOAD, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        del state
    shutil.rmtree(root / "restore-baseline")
    return (f"restore: {cost.seconds:.2f} s, peak memory +{(cost.added or 0) / GB:.2f} GB (shards memory-mapped; "
            f"includes the file pages read) vs torch.load + load_state_dict {base.seconds:.2f} s, "
            f"+{(base.added or 0) / GB:.2f} GB")


def median(values: list[float]) -> float:
    return statistics.median(values)


def bench_state(label: str, size: int, repeats: int, root: Path, shard_size: int) -> None:
    model, optimizer = adam_model(size)
    total = state_bytes(model, optimizer)
    print(f"\n== {label}: {total / GB:.2f} GB of weights + Adam state ({len(model)} layers) ==")
    base = []
    for i in range(repeats):
        seconds, _ = baseline_save(root / f"baseline-{i}", model, optimizer)
        base.append(seconds)
        shutil.rmtree(root / f"baseline-{i}")
    base_s = median(base)
    print(f"torch.save + fsync: {base_s:.2f} s (median of {repeats}: {', '.join(f'{s:.2f}' for s in base)})")
    for fraction in (1.0, 0.25):
        budget = int(total * fraction) + (MB if fraction >= 1 else 0)  # >= the state: its RNG and counters too
        saver = keeper(root / f"budget-{fraction}", model, optimizer, budget, shard_size)
        blocked, peaks, totals = [], [], []
        for i in range(repeats + 1):  # the first save allocates the staging memory: its peak counts, its time not
            perturb(model, optimizer)
            b, p, t = timed_save(saver, i + 1)
            if i == 0:
                first_peak = p
                continue
            blocked.append(b)
            peaks.append(p if p is not None else 0)
            totals.append(t)
        saver.close()
        if fraction >= 1:
            restore = bench_restore(saver, model, optimizer, root)
        b = median(blocked)
        print(f"staging budget {budget / GB:.2f} GB ({fraction:.0%} of the state):")
        print(f"  blocked per save {b:.3f} s = {b / base_s:.1%} of torch.save+fsync "
              f"(goal <= 10% with a budget >= the state); committed after {median(totals):.2f} s")
        if first_peak is not None:
            print(f"  peak memory above the state, first save (allocates the staging): {first_peak / GB:.2f} GB "
                  f"= {first_peak / max(budget, 1):.1%} of the budget (goal <= 110%); later saves "
                  f"{median(peaks) / GB:.2f} GB")
        if fraction >= 1:
            print(restore)
        shutil.rmtree(root / f"budget-{fraction}")
    del model, optimizer
    gc.collect()


def bench_lora(frozen: int, trainable: int, root: Path, shard_size: int) -> None:
    model, optimizer = lora_model(frozen, trainable)
    full = state_bytes(model, optimizer)
    trained = state_bytes(model, optimizer, trained_only=True)
    print(f"\n== LoRA-style: {frozen / GB:.2f} GB frozen base, {trained / MB:.1f} MB of adapters and their Adam "
          f"moments ==")
    _, full_bytes = baseline_save(root / "full", model, optimizer)
    shutil.rmtree(root / "full")
    saver = keeper(root / "lora", model, optimizer, None, shard_size)
    timed_save(saver, 1)
    written = saver.writer.stats.bytes
    saver.close()
    print(f"full-model checkpoint (state.pt): {full_bytes / MB:.1f} MB; resumable writes {written / MB:.2f} MB = "
          f"{written / full_bytes:.2%} (goal <= 2%); the state is {full / MB:.0f} MB")
    shutil.rmtree(root / "lora")


def bench_unchanged(size: int, root: Path, shard_size: int) -> None:
    from resumable.storage.mounted import MountedDirStore
    from resumable.storage.tiered import Mirror

    model, optimizer = adam_model(size)
    print(f"\n== second save of an unchanged {state_bytes(model, optimizer) / GB:.2f} GB state ==")
    saver = keeper(root / "run" / "checkpoints", model, optimizer, None, shard_size)
    mirror = Mirror(saver.manager, MountedDirStore(root / "remote"), root / "run", lambda _: None)
    sizes, uploads = [], []
    for step in (1, 2):
        before, sent = saver.writer.stats.bytes, mirror.bytes
        timed_save(saver, step)
        mirror.submit(step)
        mirror.flush(600)
        sizes.append(saver.writer.stats.bytes - before)
        uploads.append(mirror.bytes - sent)
    mirror.close()
    saver.close()
    print(f"written: first {sizes[0] / MB:.1f} MB, second {sizes[1] / MB:.3f} MB = {sizes[1] / sizes[0]:.3%} "
          f"(goal <= 1%); {saver.writer.stats.linked / MB:.1f} MB linked")
    print(f"uploaded to the mirror: first {uploads[0] / MB:.1f} MB, second {uploads[1] / MB:.3f} MB = "
          f"{uploads[1] / max(uploads[0], 1):.3%} (goal <= 1%)")
    shutil.rmtree(root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1.0, 4.0], help="state sizes in GB")
    parser.add_argument("--lora-frozen-gb", type=float, default=1.0)
    parser.add_argument("--lora-trainable-mb", type=float, default=10.0, help="adapters + their Adam moments")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard-size-mb", type=int, default=256)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed after)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-big-state-"))
    shard = args.shard_size_mb * MB
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, writing to {root}")
    try:
        for size in args.sizes:
            bench_state(f"{size:g} GB state", int(size * GB), args.repeats, root / "state", shard)
        bench_lora(int(args.lora_frozen_gb * GB), int(args.lora_trainable_mb * MB), root / "lora", shard)
        bench_unchanged(int(min(args.sizes) * GB), root / "unchanged", shard)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
