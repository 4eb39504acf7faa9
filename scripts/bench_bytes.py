"""One pass over the bytes: what a checkpoint save and a resume cost against the floors (issue 36, item 3).

    python scripts/bench_bytes.py --sizes 200,1000 --repeats 5
    # the same figures for format 3 (the code before the tree digest), from a checkout of it:
    mkdir -p /tmp/resumable-format3 && git archive 4ac7ce1 resumable | tar -x -C /tmp/resumable-format3
    python scripts/bench_bytes.py --sizes 200,1000 --repeats 5 --compare-with /tmp/resumable-format3

For each size (MB) of a synthetic model + Adam state (scripts/bench_checkpoint.py's synthetic_state), median of
--repeats:
  (a) torch.save + fsync of the state (the save floor);
  (b) resumable's synchronous save of the same state: CheckpointManager.save with ShardedFormat (shards, meta.pt,
      every digest, the manifest, every fsync), into a fresh folder each time (nothing to link to) -> ratio b/a;
  (c) reading the checkpoint's shard files (the state's bytes) and sha256-ing them in one pass on one thread
      (the resume floor);
  (d) resumable's resume check: latest_valid() (the deep check of every file) + load + the training-state
      fingerprint check, as StateKeeper._restore makes it -> ratio d/c;
  (e) for information, the whole StateKeeper.restore (d, plus loading into the objects, which copies every tensor
      out of the mapped files, and comparing the live state with the checkpoint's).
The page cache is warm for (c), (d) and (e): every file was read just before. The bytes hashed per save and per
resume (hashlib.sha256 wrapped to count, in separate untimed runs) are printed against the state's tensor bytes.
With --compare-with DIR, the same runs are made in a subprocess with DIR (another checkout of resumable) first on
the import path, and printed below, labelled with the format version they wrote.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_checkpoint import Holder, nbytes, synthetic_state  # noqa: E402

from resumable.checkpoint import CheckpointManager, digests  # noqa: E402
from resumable.checkpoint import format as fmt  # noqa: E402
from resumable.checkpoint.sharded import ShardedFormat  # noqa: E402
from resumable.checkpoint.tree import tensors  # noqa: E402
from resumable.engine.state.keeper import StateKeeper  # noqa: E402
from resumable.engine.state.train_state import TrainState  # noqa: E402

_SHA256 = hashlib.sha256


class Counter:
    """hashlib.sha256 wrapped: every byte any hash is fed is counted (from every thread)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.lock = threading.Lock()

    def add(self, data: Any) -> None:
        with self.lock:
            self.bytes += memoryview(data).nbytes

    def __enter__(self) -> Counter:
        counter = self

        class Counted:
            def __init__(self, data: Any = b"") -> None:
                self._hash = _SHA256()
                self.update(data)

            def update(self, data: Any) -> None:
                counter.add(data)
                self._hash.update(data)

            def digest(self) -> bytes:
                return self._hash.digest()

            def hexdigest(self) -> str:
                return self._hash.hexdigest()

        hashlib.sha256 = Counted  # type: ignore[assignment]
        return self

    def __exit__(self, *_: Any) -> None:
        hashlib.sha256 = _SHA256  # type: ignore[assignment]


def median_time(action: Callable[[], Any], repeats: int, settle: Callable[[], Any] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
        settle()
    return statistics.median(times)


def torch_save(directory: Path, state: dict) -> None:
    with open(directory / "state.pt", "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


def read_and_hash(files: list[Path]) -> str:
    """The floor: every byte read from its file and sha256-hashed once, on this thread."""
    digest = hashlib.sha256()
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while count := handle.readinto(buffer):
                digest.update(view[:count])
    return digest.hexdigest()


def resume_check(manager: CheckpointManager) -> None:
    """latest_valid (deep) + load + the fingerprint check, the way StateKeeper._restore makes them."""
    info, _ = manager.latest_valid()
    assert info is not None
    version = info.manifest.get("fingerprint_version", 1)
    if hasattr(info, "verified_digests"):  # format 4: the digests the deep check computed
        located: dict = {}
        payload = manager.load(info, located)
        found = digests.of_payload(payload, version, info.verified_digests(located))
    else:
        payload = manager.load(info)
        found = digests.of_payload(payload)
    assert found == info.fingerprint, "fingerprint mismatch"


def keeper_for(root: Path, model: dict, optim: dict) -> StateKeeper:
    return StateKeeper(CheckpointManager(root, ShardedFormat()), {"model": Holder(model), "optimizer": Holder(optim)},
                       TrainState(), meta={}, keep=1, keep_best=False)


def bench(megabytes: float, repeats: int, root: Path) -> list[str]:
    model, optim = synthetic_state(megabytes)
    state = {"model": model, "optimizer": optim}
    size = nbytes(state)
    lines = [f"state {size / 1e6:.0f} MB ({sum(1 for _ in tensors(state))} tensors), median of {repeats}:"]

    base = root / "torch"
    base.mkdir()
    a = median_time(lambda: torch_save(base, state), repeats, lambda: (base / "state.pt").unlink())

    folder = root / "ckpt"

    def save() -> None:
        CheckpointManager(folder, ShardedFormat()).save(1, state, {})

    b = median_time(save, repeats, lambda: shutil.rmtree(folder))
    with Counter() as counted:
        save()
    saved_hashed = counted.bytes
    manager = CheckpointManager(folder, ShardedFormat())
    info = manager.latest_valid()[0]
    assert info is not None
    files = sorted(p for p in info.path.iterdir() if p.name.startswith("shard-"))
    read_and_hash(files)  # the page cache is warm for the floor and for the resume
    c = median_time(lambda: read_and_hash(files), repeats)
    d = median_time(lambda: resume_check(CheckpointManager(folder, ShardedFormat())), repeats)
    with Counter() as counted:
        resume_check(CheckpointManager(folder, ShardedFormat()))
    resume_hashed = counted.bytes

    restorer = keeper_for(root / "keeper", model, optim)  # its own checkpoint: with the RNG and loop state
    restorer.save("bench", wait=True)
    restorer.manager.latest_valid()  # warm
    e = median_time(lambda: restorer.restore(restorer.manager.latest_valid()[0]), repeats)

    version = info.format_version
    shard_bytes = sum(p.stat().st_size for p in files)
    lines += [
        f"  format {version} (fingerprint version {info.manifest.get('fingerprint_version')}), "
        f"{len(files)} shards, {shard_bytes / 1e6:.0f} MB",
        f"  save:   (a) torch.save+fsync {a:.3f} s   (b) resumable sync save {b:.3f} s   "
        f"b/a = {b / a:.2f}  (goal <= 1.2)",
        f"  resume: (c) read+sha256 floor {c:.3f} s   (d) latest_valid+load+fingerprint {d:.3f} s   "
        f"d/c = {d / c:.2f}  (goal <= 1.3)",
        f"          (e) whole StateKeeper.restore {e:.3f} s   e/c = {e / c:.2f}  (loads into the objects and compares)",
        f"  bytes hashed / state bytes: save {saved_hashed / size:.3f}, resume {resume_hashed / size:.3f}  "
        f"(goal 1.00; the rest is headers, meta.pt, manifest)",
    ]
    for used in (folder, base, root / "keeper"):
        shutil.rmtree(used)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="200,1000", help="state sizes in MB, comma separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--compare-with", default=None,
                        help="another checkout of resumable (e.g. format 3) to run the same measurements with")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"resumable format {fmt.FORMAT_VERSION}, page cache warm for (c), (d), (e)", flush=True)
    for megabytes in (float(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-bytes-") as root:
            print("\n".join(bench(megabytes, args.repeats, Path(root))), flush=True)
    if args.compare_with:
        print(f"--- the same with {args.compare_with} ---", flush=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([args.compare_with, os.environ.get("PYTHONPATH", "")])}
        command = [sys.executable, __file__, "--sizes", args.sizes, "--repeats", str(args.repeats)]
        if args.dir:
            command += ["--dir", args.dir]
        return subprocess.run(command, env=env, check=False).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
