"""Checkpoint cost of a sharded (FSDP2) model against today's DDP rank-0 save, on CPU ranks with gloo.

    python scripts/bench_fsdp.py --ranks 2 --mb 300 --saves 4 --repeats 3

For each mode it launches ``torchrun --nproc-per-node RANKS`` on this script (``--worker``), which trains an MLP
whose model + AdamW state is about ``--mb`` MB with ``resumable.Run`` and a checkpoint at every one of ``--saves``
steps, and reads rank 0's checkpoint figures (resumable's own SaveStats):

  ddp      DistributedDataParallel: every rank holds the whole state, rank 0 writes it (asynchronous, the default)
  dcp-sync FSDP2 (fully_shard), every rank writes its shards through DCP while training waits
  dcp      FSDP2, asynchronous (the default): DCP's async_save, training waits for the copy only

and prints, median of --repeats runs, the time a save blocks training and its total time (blocked + background,
until the manifest is committed), each as a ratio to the ddp baseline measured in the same invocation.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("ddp", "dcp-sync", "dcp")


def worker(mode: str, run_dir: str, mb: int, saves: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import resumable

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    width = int(((mb * 1e6 / 4 / 3) / 2) ** 0.5)  # two width x width layers; AdamW keeps two more copies
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(64 * world, width), torch.randn(64 * world, width))
    run = resumable.Run(run_dir, model=model, optimizer=optimizer, data=data, batch_size=4, epochs=100,
                        checkpointing=resumable.Checkpointing(steps=1, keep=2, synchronous=mode == "dcp-sync"),
                        session=resumable.Session(max_steps=saves, hang_timeout="off"),
                        reporting=resumable.Reporting(progress=False, quiet=True))
    for _epoch, _step, (x, y) in run:
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    stats = run.stats
    state_mb = sum(p.numel() for p in model.parameters()) * 4 * 3 / 1e6  # a DTensor's numel is the whole tensor's
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"saves": stats.saves, "blocked_s": stats.blocked_s,
                                         "total_s": stats.blocked_s + stats.background_s, "state_mb": state_mb}))
    del run, model, optimizer
    gc.collect()
    dist.destroy_process_group()


def launch(mode: str, ranks: int, mb: int, saves: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "stats.json"
        command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", str(ranks),
                   __file__, "--worker", mode, "--run-dir", str(Path(scratch) / "run"), "--mb", str(mb),
                   "--saves", str(saves), "--out", str(out)]
        done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mb", type=int, default=300, help="model + optimizer state, MB")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(options.worker, options.run_dir, options.mb, options.saves, options.out)
        return
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(options.repeats):  # interleaved, so that a slower period of the machine hits every mode
        for mode in MODES:
            runs[mode].append(launch(mode, options.ranks, options.mb, options.saves))
    state = runs["ddp"][0]["state_mb"]
    print(f"\n{options.ranks} CPU ranks (gloo), model + AdamW state {state:.0f} MB, {options.saves} saves a run, "
          f"median of {options.repeats} runs (rank 0's figures):")
    base = {key: statistics.median(r[key] / r["saves"] for r in runs["ddp"]) for key in ("blocked_s", "total_s")}
    for mode in MODES:
        blocked = statistics.median(r["blocked_s"] / r["saves"] for r in runs[mode])
        total = statistics.median(r["total_s"] / r["saves"] for r in runs[mode])
        print(f"  {mode:9s} blocked {blocked * 1e3:7.1f} ms a save ({blocked / base['blocked_s']:.2f}x ddp)   "
              f"total {total * 1e3:7.1f} ms a save ({total / base['total_s']:.2f}x ddp)")


if __name__ == "__main__":
    main()
