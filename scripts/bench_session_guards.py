"""What the notebook guards cost and how fast they answer (issue #30):

* the per-step check that the objects being trained are the ones a Run saves (engine/state/verify.py TrainingWatch: a
  global optimizer post-step hook, then a look at what stepped), against the same optimizer steps without it;
* the copy a fresh start in a notebook keeps of what it was given (engine/session/fresh_start.py), by the state's size;
* with ``--kernel`` (needs ipykernel and jupyter_client, the dev extra): in a real Jupyter kernel, the time from a
  loop body that hangs to the cell ending with ``Hung`` (``hang_timeout="2s"``), against the timeout itself.

    python scripts/bench_session_guards.py --steps 20000 --repeats 5 --sizes 10,100,400 --kernel
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from resumable.engine.session import fresh_start
from resumable.engine.state.verify import TrainingWatch


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, watch: TrainingWatch | None,
           x: torch.Tensor) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        if watch is not None:
            watch.begin()
        optimizer.zero_grad(set_to_none=True)
        model(x).sum().backward()
        optimizer.step()
        if watch is not None:
            watch.check()
    return time.perf_counter() - started


def per_step(steps: int, repeats: int) -> tuple[float, float]:
    """Median seconds per step (plain, watched) for a tiny model, where the guard's share is largest."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    _steps(model, optimizer, steps // 10, None, x)  # warm-up
    plain, watched = [], []
    for _ in range(repeats):  # alternated, so drift on a busy machine hits both alike
        plain.append(_steps(model, optimizer, steps, None, x) / steps)
        watch = TrainingWatch([optimizer], model)
        watched.append(_steps(model, optimizer, steps, watch, x) / steps)
        watch.close()
    return statistics.median(plain), statistics.median(watched)


def fresh_copy(megabytes: int, repeats: int) -> float:
    """Median seconds to keep the copy of a model of ``megabytes`` MB of float32 weights and an SGD optimizer."""
    width = 1024
    rows = max(megabytes * 1_000_000 // (4 * width), 1)
    model = torch.nn.Linear(width, rows, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    objects = {"model": (model, model), "optimizer": (optimizer, optimizer)}
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fresh_start._take(objects, model, keep_copy=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


_HANG_CELL = """
import time, torch, resumable
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
run = resumable.Run(RUN_DIR, model=model, optimizer=optimizer, data=data, batch_size=8, progress=False,
                    hang_timeout="2s", quiet=True)
for epoch, step, (x, y) in run:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    if step == 5:
        print("hung at", time.time(), flush=True)
        time.sleep(600)
"""


def hang_to_exception(repeats: int) -> list[float]:
    """Seconds from the loop body starting to hang (after 5 steps) to the cell ending with Hung, in one kernel."""
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3")
    latencies = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            for attempt in range(repeats):
                msg_id = client.execute(f"RUN_DIR = {str(Path(folder) / str(attempt))!r}\n" + _HANG_CELL)
                hung_at, error = None, None
                while True:
                    msg = client.get_iopub_msg(timeout=120)
                    if msg["parent_header"].get("msg_id") != msg_id:
                        continue
                    content = msg["content"]
                    if msg["msg_type"] == "stream" and "hung at" in content["text"]:
                        hung_at = float(content["text"].split()[-1])
                    elif msg["msg_type"] == "error":
                        error = content["ename"]
                    elif msg["msg_type"] == "status" and content["execution_state"] == "idle":
                        break
                ended = time.time()
                if error != "Hung" or hung_at is None:
                    raise SystemExit(f"the cell did not end with Hung (error {error!r})")
                latencies.append(ended - hung_at)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="10,100,400", help="model sizes in MB for the fresh-start copy")
    parser.add_argument("--kernel", action="store_true", help="also time a hang in a real Jupyter kernel")
    args = parser.parse_args()
    plain, watched = per_step(args.steps, args.repeats)
    print(f"optimizer step of a tiny Linear(16, 4), median of {args.repeats} x {args.steps} steps:")
    print(f"  plain {plain * 1e6:.1f} us, with TrainingWatch {watched * 1e6:.1f} us: "
          f"+{(watched - plain) * 1e6:.2f} us per step, ratio {watched / plain:.3f}")
    print(f"fresh-start copy (interactive kernels only), median of {args.repeats}:")
    for size in (int(s) for s in args.sizes.split(",")):
        seconds = fresh_copy(size, args.repeats)
        print(f"  {size} MB of weights: {seconds * 1000:.1f} ms ({size / 1000 / max(seconds, 1e-9):.2f} GB/s)")
    if args.kernel:
        latencies = hang_to_exception(args.repeats)
        print(f"hang to Hung in a Jupyter kernel, hang_timeout 2s, median of {args.repeats}: "
              f"{statistics.median(latencies):.2f} s (each: {', '.join(f'{t:.2f}' for t in latencies)})")


if __name__ == "__main__":
    main()
