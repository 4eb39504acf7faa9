"""Start-up costs of a resume: the verification after a checkpoint is loaded, and replaying a plain iterable.

    python scripts/bench_stream_resume.py --repeats 5 [--big-layers 3] [--consumed 10000,100000] [--workers 0,2]

1. verify: a Run trains 2 steps and commits a checkpoint; then, --repeats times, a fresh Run (new model and
   Adam optimizer) over the same run dir resumes and delivers its first batch. The time of ``verify_restored``
   (engine/state/verify.py) is compared with the whole checkpoint restore that calls it (``StateKeeper._restore``:
   load, fingerprint check, load_state_dict, verification), for the MNIST CNN and for a synthetic MLP
   (--big-layers layers of 4096x4096).
2. replay: a Run over an IterableDataset of small samples (16 floats + a label, made from the index) commits a
   checkpoint after --consumed samples; then a fresh Run resumes it until its first batch is delivered, for the
   dataset without state_dict()/load_state_dict() (replayed from the start of the epoch, engine/data/stream.py) and
   with them (O(1)), against plainly iterating the same samples through a DataLoader.
3. content check: the digest of the next batch that every save records (engine/data/content_check.py), for map-style
   indices, an MNIST batch, an LM token batch and a large image batch, against cloning the same batch.

Every figure is a median of --repeats, printed only (nothing is asserted); resumable's own log is hidden
unless --verbose.
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info

from resumable import Checkpointing, Loader, Reporting, Session
from resumable.engine.data.stream import DatasetStream
from resumable.engine.run import Run
from resumable.engine.state import keeper as checkpointer_module
from resumable.engine.state.keeper import StateKeeper
from resumable.tasks.mnist import build_model, make_optimizer

BATCH = 32
STREAM_SIZE = 200_000
_BASE = torch.arange(16, dtype=torch.float32) / 16


def timing(function: Callable[..., Any], into: list[float], results: list[Any] | None = None) -> Callable[..., Any]:
    """``function``, appending the seconds of each call to ``into`` (and what it returns to ``results``)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            result = function(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)
        if results is not None:
            results.append(result)
        return result

    return wrapper


def first_batch(make: Callable[[], Run]) -> float:
    """Seconds from building ``make()``'s Run to its first batch (the resume included); no step is trained and
    closing the Run writes no checkpoint."""
    started = time.perf_counter()
    with make() as run:
        next(iter(run))
        return time.perf_counter() - started


def train(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    for _, _, (x, y) in run:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if not run.finished:
        raise RuntimeError(f"the set-up run in {run.run_dir} did not finish and commit its checkpoint")


# -- 1. verification -------------------------------------------------------------------------------------
def mlp(layers: int, width: int = 4096) -> nn.Module:
    hidden = (m for _ in range(layers) for m in (nn.ReLU(), nn.Linear(width, width)))
    return nn.Sequential(nn.Linear(256, width), *hidden, nn.ReLU(), nn.Linear(width, 10))


def bench_verify(name: str, make_model: Callable[[], nn.Module], inputs: torch.Tensor, batch_size: int,
                 repeats: int, root: Path) -> None:
    data = TensorDataset(inputs, torch.randint(0, 10, (len(inputs),)))
    run_dir = root / name

    def objects() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = make_model()
        return model, make_optimizer(model, 1e-3, torch.device("cpu"))

    def run(model: nn.Module, optimizer: torch.optim.Optimizer, max_steps: int) -> Run:
        return Run(run_dir, model=model, optimizer=optimizer, data=data, batch_size=batch_size,
                   checkpointing=Checkpointing(every=None, synchronous=True), session=Session(max_steps=max_steps),
                   reporting=Reporting(progress=False))

    model, optimizer = objects()
    train(run(model, optimizer, 2), model, optimizer)
    restores: list[float] = []
    verifies: list[float] = []
    firsts: list[float] = []
    checked: list[str] = []
    with mock.patch.object(StateKeeper, "_restore", timing(StateKeeper._restore, restores)), \
         mock.patch.object(checkpointer_module, "verify_restored",
                           timing(checkpointer_module.verify_restored, verifies, checked)):
        for _ in range(repeats):
            model, optimizer = objects()  # made outside the timed span: only the Run and its resume count
            firsts.append(first_batch(lambda m=model, o=optimizer: run(m, o, 3)))
    if len(restores) != repeats or len(verifies) != repeats:
        raise RuntimeError(f"{name}: expected {repeats} restores and verifications, saw {len(restores)} and "
                           f"{len(verifies)}")
    params = sum(p.numel() for p in make_model().parameters())
    verify_s, restore_s, first_s = (statistics.median(v) for v in (verifies, restores, firsts))
    print(f"verify  {name:<10} {params / 1e6:6.1f}M params  {verify_s:7.3f} s = {100 * verify_s / restore_s:4.1f}% "
          f"of restore {restore_s:6.3f} s  (resume to first batch {first_s:6.3f} s)")
    print(f"        checked {checked[-1]}")


# -- 2. replay ---------------------------------------------------------------------------------------------
def sample(index: int) -> tuple[torch.Tensor, int]:
    return _BASE + index * 1e-3, index % 10


class Samples(IterableDataset):
    """``size`` samples made from their index; each DataLoader worker reads every num_workers-th one.
    No state_dict(): a resume replays the stream."""

    def __init__(self, size: int) -> None:
        self.size = size

    def indices(self) -> range:
        info = get_worker_info()
        return range(info.id, self.size, info.num_workers) if info is not None else range(self.size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        return map(sample, self.indices())


class StatefulSamples(Samples):
    """The same samples with state_dict()/load_state_dict(): a resume starts at the saved position."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.position = 0  # of this worker's share, after the last sample handed out
        self.start = 0  # where the next __iter__ begins (a loaded state)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        indices = self.indices()
        self.position, self.start = self.start, 0
        while self.position < len(indices):
            self.position += 1
            yield sample(indices[self.position - 1])

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["position"]


def bench_replay(consumed: int, workers: int, repeats: int, root: Path) -> str:
    """One table row: resume to first batch by replay and by protocol, the replay itself, plain iteration."""
    steps = max(consumed // BATCH, 1)

    def make(kind: type[Samples], max_steps: int) -> tuple[Run, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Linear(16, 10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        return (Run(root / f"{kind.__name__}-{consumed}-{workers}", model=model, optimizer=optimizer,
                    data=kind(STREAM_SIZE), batch_size=BATCH, loader=Loader(num_workers=workers),
                    checkpointing=Checkpointing(every=None, synchronous=True), session=Session(max_steps=max_steps),
                    reporting=Reporting(progress=False)), model, optimizer)

    resumes: dict[type[Samples], list[float]] = {}
    replays: list[float] = []  # seconds of each replay, as the replay warning reports them
    original = DatasetStream._replayed

    def replayed(stream: DatasetStream, batches: int, samples: int, seconds: float, avoid: str) -> None:
        replays.append(seconds)
        original(stream, batches, samples, seconds, avoid)

    for kind in (Samples, StatefulSamples):
        train(*make(kind, steps))
        before = len(replays)
        with mock.patch.object(DatasetStream, "_replayed", replayed):
            resumes[kind] = [first_batch(lambda kind=kind: make(kind, steps + 1)[0]) for _ in range(repeats)]
        if len(replays) - before != (repeats if kind is Samples else 0):
            raise RuntimeError(f"{kind.__name__}: {len(replays) - before} replay(s) reported in {repeats} resumes")
    replay_s = statistics.median(replays)

    def plain() -> None:
        loader = DataLoader(Samples(STREAM_SIZE), batch_size=BATCH, num_workers=workers)
        for _ in zip(range(steps), loader, strict=False):
            pass

    plains = []
    for _ in range(repeats):
        started = time.perf_counter()
        plain()
        plains.append(time.perf_counter() - started)
    plain_s = statistics.median(plains)
    replay_resume, protocol_resume = (statistics.median(resumes[k]) for k in (Samples, StatefulSamples))
    cells = (f"{steps * BATCH:>8,}", f"{workers:>7}", f"{replay_resume:>13.3f}", f"{replay_s:>11.3f}",
             f"{protocol_resume:>15.3f}", f"{plain_s:>10.3f}", f"{replay_s / plain_s:>12.2f}",
             f"{replay_resume / protocol_resume:>16.1f}")
    return " | ".join(cells)


def bench_digest(repeats: int) -> None:
    """The content check's cost (engine/data/content_check.py): the digest of the next batch that every save records,
    and that a resume computes once for its first batch, against copying the same batch (clone) as the baseline."""
    from resumable.engine.data.content_check import digest

    cases = [("map-style indices, batch 128", torch.randperm(60000)[:128]),
             ("MNIST batch 128 (0.4 MB)", {"x": torch.rand(128, 1, 28, 28), "y": torch.randint(0, 10, (128,))}),
             ("LM batch 32x1024 tokens (0.3 MB)", {"input_ids": torch.randint(0, 50000, (32, 1024))}),
             ("images 256x3x224x224 float (154 MB)", {"x": torch.rand(256, 3, 224, 224)})]
    print("\ncontent check: digest of one batch (every save; once at a resume) vs cloning it")
    print(f"{'batch':>36} | {'digest ms':>9} | {'clone ms':>8} | {'digest/clone':>12}")
    for name, batch in cases:
        times: dict[str, list[float]] = {"digest": [], "clone": []}
        copy = (lambda b: {k: v.clone() for k, v in b.items()}) if isinstance(batch, dict) else torch.clone
        for _ in range(repeats):
            for label, function in (("digest", digest), ("clone", copy)):
                started = time.perf_counter()
                function(batch)
                times[label].append(time.perf_counter() - started)
        d, c = (statistics.median(times[k]) * 1e3 for k in ("digest", "clone"))
        print(f"{name:>36} | {d:>9.2f} | {c:>8.2f} | {d / c:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--big-layers", type=int, default=3, help="hidden 4096x4096 layers of the synthetic MLP")
    parser.add_argument("--consumed", default="10000,100000", help="comma-separated samples consumed before resuming")
    parser.add_argument("--workers", default="0", help="comma-separated DataLoader num_workers for the replay part")
    parser.add_argument("--quick", action="store_true", help="2 repeats, a 1-layer MLP, 10k samples only")
    parser.add_argument("--verbose", action="store_true", help="show resumable's own log (stderr)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.big_layers, args.consumed = 2, 1, "10000"
    if not args.verbose:
        logging.getLogger("resumable").setLevel(logging.ERROR)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeats={args.repeats} (medians)")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        bench_verify("mnist-cnn", lambda: build_model(torch.device("cpu")), torch.randn(256, 1, 28, 28), 64,
                     args.repeats, Path(root))
        bench_verify("mlp", lambda: mlp(args.big_layers), torch.randn(64, 256), 16, args.repeats, Path(root))
        header = ("consumed", "workers", "resume replay", "replay only", "resume protocol", "plain iter",
                  "replay/plain", "replay/protocol")
        print(f"\nreplay: samples of 16 floats + label, batch {BATCH}; seconds (resume: Run built → first "
              f"batch; replay only: the replay's own time, as its warning reports it)")
        print(" | ".join(f"{h:>{w}}" for h, w in zip(header, (8, 7, 13, 11, 15, 10, 12, 16), strict=True)))
        for consumed in (int(c) for c in args.consumed.split(",")):
            for workers in (int(w) for w in args.workers.split(",")):
                print(bench_replay(consumed, workers, args.repeats, Path(root)), flush=True)
    bench_digest(args.repeats)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
