"""Throughput of the seed guide's own MNIST loop vs resumable's training path, in one process.

    python scripts/bench_throughput.py ../shared/data/mnist-mini --epochs 1 --repeats 3

(a) the guide as written: torchvision MNIST + ToTensor/Normalize, DataLoader(batch 128, shuffle,
    num_workers=2), Adam, test after each epoch;
(b) ``resumable-train``'s path (runner.train: device-resident tensors, checkpoint at each epoch end).
Both are timed end to end (data loading, training, per-epoch test) and report training samples/s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import datasets, transforms

from resumable.reporting.metrics import read_records
from resumable.tasks.mnist import Net
from resumable.tasks.train_mnist import train as resumable_train


def guide_loop(data_dir: str, epochs: int, seed: int, device: str) -> tuple[float, float, int]:
    """The classic guide's loop; returns (seconds, test accuracy, training samples)."""
    torch.manual_seed(seed)
    start = time.perf_counter()
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train_set = datasets.MNIST(data_dir, train=True, download=False, transform=transform)
    test_set = datasets.MNIST(data_dir, train=False, download=False, transform=transform)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=128, shuffle=True, num_workers=2)
    test_loader = torch.utils.data.DataLoader(test_set, batch_size=1000, num_workers=2)
    model = Net()
    model.dropout1, model.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)  # the guide's own modules
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    acc = 0.0
    for _ in range(epochs):
        model.train()
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(images), labels)
            loss.backward()
            optimizer.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for images, labels in test_loader:
                images, labels = images.to(device), labels.to(device)
                correct += (model(images).argmax(1) == labels).sum().item()
        acc = correct / len(test_set)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, acc, epochs * len(train_set)


def resumable_path(data_dir: str, epochs: int, seed: int, device: str) -> tuple[float, float, int]:
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        resumable_train({"run_dir": run_dir, "data_dir": data_dir, "epochs": epochs, "seed": seed,
                         "device": device, "progress": False, "download": False}, mode="fresh")
        seconds = time.perf_counter() - start
        records = read_records(Path(run_dir) / "metrics.jsonl")
    acc = [r["test_acc"] for r in records if "test_acc" in r][-1]
    return seconds, acc, epochs * len(datasets.MNIST(data_dir, train=True, download=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dir")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, epochs={args.epochs}")
    rates: dict[str, list[float]] = {"guide": [], "resumable": []}
    accs: dict[str, list[float]] = {"guide": [], "resumable": []}
    for repeat in range(args.repeats):
        for name, fn in (("guide", guide_loop), ("resumable", resumable_path)):
            # A different seed per repeat, the same for both paths: accuracy medians then compare the
            # methods rather than one lucky draw of dropout masks and data order.
            seconds, acc, samples = fn(args.data_dir, args.epochs, args.seed + repeat, args.device)
            rates[name].append(samples / seconds)
            accs[name].append(acc)
            print(f"  repeat {repeat + 1}: {name:<10} {samples / seconds:8.0f} samples/s  test_acc {acc:.4f}")
    guide, ours = statistics.median(rates["guide"]), statistics.median(rates["resumable"])
    print(f"median samples/s: guide {guide:.0f}, resumable {ours:.0f}; ratio {ours / guide:.2f}x")
    print(f"median test_acc: guide {statistics.median(accs['guide']):.4f}, "
          f"resumable {statistics.median(accs['resumable']):.4f}")


if __name__ == "__main__":
    main()
