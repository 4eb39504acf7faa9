"""Training-thread blocked time of a checkpoint save, for synthetic states of several sizes.

    python scripts/bench_checkpoint.py --sizes 15,200,1000 --repeats 5 [--mnist ../shared/data/mnist-mini]

For each size (MB) it times, median of --repeats:
  (a) torch.save + fsync on the training thread,
  (b) resumable, synchronous (--sync-checkpoints): payload, sha256, fingerprint, manifest, fsyncs,
  (c) resumable, asynchronous (the default): the time save() blocks training,
  (d) torch.distributed.checkpoint.async_save (single process): the time the call blocks,
and the floor: a plain memcpy of the same bytes into warm buffers. Background work of (c) and (d) is
waited for between repeats and not counted as blocked.

With --mnist it also trains the MNIST CNN in this process with --checkpoint-every 10s and with the
time trigger off (epoch-end saves only), alternating, and prints the samples/s ratio and the share of
training time blocked by saves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from resumable.checkpoint import CheckpointManager
from resumable.checkpoint.writer import CheckpointWriter
from resumable.engine.state.keeper import StateKeeper
from resumable.engine.state.train_state import TrainState

CHUNK = 4 * 1024 * 1024  # floats per tensor (16 MB), like the large layers of a real model


class Holder:
    """A Stateful around a fixed state dict."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def synthetic_state(megabytes: float, device: str = "cpu") -> tuple[dict, dict]:
    """A model and an Adam-like optimizer state (2 moments per parameter) of ``megabytes`` in total."""
    floats = int(megabytes * 1e6 / 4 / 3)
    sizes = [CHUNK] * (floats // CHUNK) + ([floats % CHUNK] if floats % CHUNK else [])
    model = {f"layer{i}.weight": torch.randn(n, device=device) for i, n in enumerate(sizes)}
    optim = {"state": {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(n, device=device),
                           "exp_avg_sq": torch.rand(n, device=device)}
                       for i, n in enumerate(sizes)},
             "param_groups": [{"lr": 1e-3, "params": list(range(len(sizes)))}]}
    return model, optim


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def timed(action: Callable[[], None], settle: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``action``; ``settle`` (untimed) finishes background work between repeats."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
        settle()
    return statistics.median(times)


def bench_size(megabytes: float, repeats: int, root: Path, device: str = "cpu") -> dict[str, float]:
    model, optim = synthetic_state(megabytes, device)
    state = {"model": model, "optimizer": optim}
    results: dict[str, float] = {"bytes": nbytes(state)}

    def torch_save() -> None:
        with open(root / "plain.pt", "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())

    results["torch.save+fsync"] = timed(torch_save, lambda: None, repeats)

    for name, asynchronous in (("resumable sync", False), ("resumable async", True)):
        session = StateKeeper(CheckpointManager(root / name.replace(" ", "-")), {"model": Holder(model),
                          "optimizer": Holder(optim)}, TrainState(), meta={}, keep=1, keep_best=False,
                          writer=CheckpointWriter(asynchronous=asynchronous))

        def save(session: StateKeeper = session) -> None:
            session.state.step += 1
            session.save("bench")

        results[name] = timed(save, session.close, repeats)

    import torch.distributed.checkpoint as dcp

    futures = []
    counter = [0]

    def dcp_save() -> None:
        counter[0] += 1
        futures.append(dcp.async_save(state, checkpoint_id=str(root / f"dcp-{counter[0]}")))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results["dcp.async_save"] = timed(dcp_save, lambda: futures.pop().result(), repeats)

    flat = list(_tensors(state))
    buffers = [torch.empty_like(t, device="cpu", pin_memory=t.is_cuda) for t in flat]

    def memcpy() -> None:  # into warm host buffers (pinned for GPU tensors), like the snapshot
        for dst, src in zip(buffers, flat, strict=True):
            dst.copy_(src, non_blocking=src.is_cuda)
        if device == "cuda":
            torch.cuda.synchronize()

    memcpy()  # warm the destination pages
    results["memcpy floor"] = timed(memcpy, lambda: None, repeats)
    return results


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def bench_mnist(data_dir: str, repeats: int, epochs: int) -> None:
    """samples/s with the time trigger off (epoch-end saves only), at 10s, and at 1s (which exposes the
    per-save cost on this small dataset, whose epochs take only a few seconds), alternating."""
    from resumable.tasks.train_mnist import train

    settings = (("off", None), ("10s", "10s"), ("1s", "1s"))
    rates: dict[str, list[float]] = {label: [] for label, _ in settings}
    blocked: dict[str, list[float]] = {label: [] for label, _ in settings}
    for _ in range(repeats):
        for label, every in settings:
            with tempfile.TemporaryDirectory() as run_dir:
                started = time.perf_counter()
                result = train({"run_dir": run_dir, "data_dir": data_dir, "epochs": epochs, "progress": False,
                                "download": False, "checkpoint_every": every}, mode="fresh")
                seconds = time.perf_counter() - started
            rates[label].append(result.state.samples_seen / seconds)
            blocked[label].append(result.stats.blocked_s / seconds)
            print(f"  mnist checkpoint-every {label:>3}: {rates[label][-1]:7.0f} samples/s, "
                  f"{result.stats.saves} saves, blocked {result.stats.blocked_s * 1000:.1f} ms")
    off = statistics.median(rates["off"])
    for label, _ in settings[1:]:
        on = statistics.median(rates[label])
        print(f"MNIST end to end, --checkpoint-every {label}: samples/s vs off = {on / off:.4f} "
              f"(overhead {100 * (1 - on / off):+.2f}%), training-thread blocked share "
              f"{100 * statistics.median(blocked[label]):.3f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="15,200,1000", help="comma-separated state sizes in MB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--mnist", default=None, help="MNIST data dir for the end-to-end overhead run")
    parser.add_argument("--mnist-epochs", type=int, default=3)
    parser.add_argument("--mnist-repeats", type=int, default=5)
    parser.add_argument("--cuda", action="store_true", help="put the synthetic state on the GPU")
    args = parser.parse_args()
    device = "cuda" if args.cuda else "cpu"
    print(f"torch {torch.__version__}, state on {device}, {torch.get_num_threads()} threads, repeats={args.repeats}")
    header = ("size", "torch.save+fsync", "resumable sync", "resumable async", "dcp.async_save", "memcpy floor")
    print(" | ".join(f"{h:>16}" for h in header) + " | async/sync | async/floor")
    for size in (float(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            r = bench_size(size, args.repeats, Path(root), device)
        cells = [f"{r['bytes'] / 1e6:.0f} MB"] + [f"{r[h] * 1000:.1f} ms" for h in header[1:]]
        ratios = r["resumable async"] / r["resumable sync"], r["resumable async"] / r["memcpy floor"]
        print(" | ".join(f"{c:>16}" for c in cells) + f" | {ratios[0]:10.3f} | {ratios[1]:11.2f}")
    if args.mnist:
        bench_mnist(args.mnist, args.mnist_repeats, args.mnist_epochs)


if __name__ == "__main__":
    main()
