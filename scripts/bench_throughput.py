"""Throughput of the seed guide's own MNIST loop vs resumable's training path, in one process and as whole processes.

    python scripts/bench_throughput.py ../shared/data/mnist-mini --epochs 3 --repeats 3
    python scripts/bench_throughput.py ../shared/data/mnist-mini --process --epochs 2 --repeats 3

(a) the guide as written: torchvision MNIST + ToTensor/Normalize, DataLoader(batch 128, shuffle,
    num_workers=2), Adam, test after each epoch;
(b) ``resumable-train``'s path (runner.train: device-resident tensors, checkpoint at each epoch end);
(c) the compute floor: the same model's forward, backward and Adam step on batches already in memory (the layout
    resumable-train uses), nothing else: no data loading, no test, no checkpoint. No training path of this model
    can be faster than (c) without changing its arithmetic, so (c)/(a) bounds what (b)/(a) can reach here.
All are timed end to end inside their process (not its start-up) and report training samples/s, alternated
--repeats times (medians); each runs in a fresh process of its own, so that resumable-train's process-wide allocator
setting (engine/state/host_memory.py, which the floor makes too) does not reach the guide.

``--process``: each of (a) and (b) as a whole ``python`` process (start-up, training, test, exit), alternating pairs;
prints the wall-time ratio guide / resumable-train.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
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


def compute_floor(data_dir: str, epochs: int, seed: int, device: str) -> tuple[float, float, int]:
    """Forward, backward and Adam on device-resident batches of the training set, in a fixed shuffled order."""
    from resumable.engine.state.host_memory import keep_freed_blocks
    from resumable.tasks.mnist import load_mnist, loss_fn

    if device == "cpu":
        keep_freed_blocks()  # as resumable-train does on the CPU: the floor of the same process
    train = load_mnist(data_dir, torch.device(device), download=False).train
    torch.manual_seed(seed)
    model = Net().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    order = torch.randperm(len(train))
    batches = [order[i:i + 128] for i in range(0, len(order), 128)]
    start = time.perf_counter()
    for _ in range(epochs):
        for indices in batches:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(train.images[indices]), train.labels[indices]).backward()
            optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, float("nan"), epochs * len(train)


GUIDE_SCRIPT = """
import sys, time
sys.path.insert(0, {scripts!r})
from bench_throughput import guide_loop
seconds, acc, samples = guide_loop(sys.argv[1], int(sys.argv[2]), 1, sys.argv[3])
print(f"guide: {{samples / seconds:.0f}} samples/s in its loop, test_acc {{acc:.4f}}")
"""


def whole_processes(args: argparse.Namespace) -> None:
    """Each path as a whole process, alternating: wall time from start to exit, the ratio guide / resumable-train."""
    walls: dict[str, list[float]] = {"guide": [], "resumable-train": []}
    with tempfile.TemporaryDirectory() as work:
        script = Path(work) / "guide.py"
        script.write_text(GUIDE_SCRIPT.format(scripts=str(Path(__file__).resolve().parent)))
        commands = {
            "guide": [sys.executable, str(script), args.data_dir, str(args.epochs), args.device],
            "resumable-train": [str(Path(sys.executable).parent / "resumable-train"), "--data-dir", args.data_dir,
                                "--epochs", str(args.epochs), "--no-progress", "--no-download", "--device",
                                args.device],
        }
        for repeat in range(args.repeats):
            for name, command in commands.items():
                if name == "resumable-train":  # a fresh run each time
                    command = [*command, "--run-dir", str(Path(work) / f"run{repeat}")]
                start = time.perf_counter()
                done = subprocess.run(command, capture_output=True, text=True, cwd=work)
                walls[name].append(time.perf_counter() - start)
                if done.returncode != 0:
                    raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
                print(f"  repeat {repeat + 1}: {name:<16} {walls[name][-1]:6.2f} s")
    guide, ours = statistics.median(walls["guide"]), statistics.median(walls["resumable-train"])
    print(f"median wall time of a whole {args.epochs}-epoch process: guide {guide:.2f} s, resumable-train "
          f"{ours:.2f} s; ratio guide/resumable-train {guide / ours:.2f}x")


PATHS = {"guide": guide_loop, "resumable": resumable_path, "floor": compute_floor}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dir")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--process", action="store_true", help="time whole processes instead (see above)")
    parser.add_argument("--child", choices=sorted(PATHS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, epochs={args.epochs}")
    if args.process:
        whole_processes(args)
        return
    if args.child:  # one path, timed inside this process (see below)
        seconds, acc, samples = PATHS[args.child](args.data_dir, args.epochs, args.seed, args.device)
        print(json.dumps({"seconds": seconds, "acc": acc, "samples": samples}))
        return
    rates: dict[str, list[float]] = {name: [] for name in PATHS}
    accs: dict[str, list[float]] = {name: [] for name in PATHS}
    for repeat in range(args.repeats):
        for name in PATHS:
            # Each path in a process of its own, timed inside it (its loop, not its start-up): resumable-train tunes
            # the process's allocator (engine/state/host_memory.py), which must not reach the guide's baseline.
            # A different seed per repeat, the same for every path: accuracy medians then compare the methods
            # rather than one lucky draw of dropout masks and data order.
            done = subprocess.run([sys.executable, __file__, args.data_dir, "--child", name, "--epochs",
                                   str(args.epochs), "--seed", str(args.seed + repeat), "--device", args.device],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            seconds, acc, samples = result["seconds"], result["acc"], result["samples"]
            rates[name].append(samples / seconds)
            accs[name].append(acc)
            print(f"  repeat {repeat + 1}: {name:<10} {samples / seconds:8.0f} samples/s  test_acc {acc:.4f}")
    guide, ours, floor = (statistics.median(rates[name]) for name in ("guide", "resumable", "floor"))
    print(f"median samples/s: guide {guide:.0f}, resumable {ours:.0f}, compute floor {floor:.0f}; "
          f"resumable/guide {ours / guide:.2f}x, floor/guide {floor / guide:.2f}x, resumable/floor {ours / floor:.2f}")
    print(f"median test_acc: guide {statistics.median(accs['guide']):.4f}, "
          f"resumable {statistics.median(accs['resumable']):.4f}")


if __name__ == "__main__":
    main()
