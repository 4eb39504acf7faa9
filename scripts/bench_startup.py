"""Start-up and exit of a training process: ours against torch's own, timed from the outside.

    python scripts/bench_startup.py ../shared/data/mnist-mini --repeats 5

Each variant is a fresh ``python`` process, timed by this script from the moment it is started: the moment its first
optimizer step has run (a global ``torch.optim`` step hook prints a marker), the moment its last output arrives, and
the moment it has exited. Variants, alternated ``--repeats`` times (medians printed):

* ``import torch``: the interpreter and torch, nothing else (the floor of any PyTorch process);
* ``plain torch``: the guide's CNN and Adam, one step on a batch of 128 MNIST images read from the raw files, in
  plain PyTorch (what any training script pays before its first step, torch's own lazy imports included);
* ``resumable-train``: ``resumable-train --max-steps 1`` on a fresh run dir: start, first step, a checkpoint, exit;
* ``resumable-train resume``: the same command on a run dir that already holds step 1's checkpoint, with
  ``--max-steps 2`` (find and verify the checkpoint, restore, one step, save, exit);
* ``Run API``: a user's own loop through ``resumable.Run`` (the same CNN and data, ``max_steps=1``).

Printed: the first step's time after ``import torch`` and after ``plain torch``'s first step (goal: ours at most
``import torch`` + 0.5 s, see the note on torch's own lazy import below), and the time from the last output line to
the exit (goal: at most 0.2 s).

torch's first ``optimizer.step()`` imports ``torch._dynamo`` (torch/optim/optimizer.py ``_use_grad`` imports it
unconditionally, and ``Optimizer.__init__``'s ``add_param_group`` does so through ``torch._disable_dynamo``):
about 0.9 s on this machine's cores, paid by every PyTorch training process, which ``plain torch`` shows.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK = "RESUMABLE_BENCH_FIRST_STEP"

HOOK = f"""
import os, torch
from torch.optim.optimizer import register_optimizer_step_post_hook
def _first(optimizer, args, kwargs, _done=[]):
    if not _done:
        _done.append(1)
        os.write(1, b"{MARK}\\n")
register_optimizer_step_post_hook(_first)
"""

PLAIN = HOOK + """
import sys
import torch.nn.functional as F
from resumable.tasks.mnist import Net, load_mnist
train = load_mnist(sys.argv[1], torch.device("cpu"), download=False).train
torch.manual_seed(1)
model = Net()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
optimizer.zero_grad()
F.nll_loss(model(train.images[:128]), train.labels[:128]).backward()
optimizer.step()
print("done", flush=True)
"""

TRAIN = HOOK + """
import sys
from resumable.cli import train_command
sys.argv = ["resumable-train", *sys.argv[1:]]
train_command()
"""

RUN_API = HOOK + """
import sys
import torch.nn.functional as F
import resumable
from resumable.tasks.mnist import Net, load_mnist
train = load_mnist(sys.argv[1], torch.device("cpu"), download=False).train
torch.manual_seed(1)
model = Net()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
dataset = torch.utils.data.TensorDataset(train.images, train.labels)
with resumable.Run(sys.argv[2], model=model, optimizer=optimizer, data=dataset, batch_size=128, epochs=1,
                   session=resumable.Session(max_steps=1), reporting=resumable.Reporting(progress=False)) as run:
    for epoch, step, (x, y) in run:
        optimizer.zero_grad()
        F.nll_loss(model(x), y).backward()
        optimizer.step()
print("done", flush=True)
"""


def timeline(argv: list[str], cwd: Path, pycache: Path) -> dict[str, float]:
    """Start ``argv`` and time it: first step marker, last output, exit (seconds from the start).

    Compiled bytecode is cached in ``pycache`` (an editable install under ``PYTHONDONTWRITEBYTECODE`` would
    otherwise compile resumable's modules in every process, which an installed package never does)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONUNBUFFERED="1", PYTHONPYCACHEPREFIX=str(pycache))
    start = time.perf_counter()
    child = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert child.stdout is not None
    fd = child.stdout.fileno()
    output, first, last = b"", None, start
    while True:
        select.select([fd], [], [])
        chunk = os.read(fd, 65536)
        now = time.perf_counter()
        if not chunk:
            break
        output += chunk
        last = now
        if first is None and MARK.encode() in output:
            first = now
    code = child.wait()
    ended = time.perf_counter()
    if code != 0 or (first is None and "import torch" not in argv[-1]):
        raise SystemExit(f"{argv} failed ({code}):\n{output.decode(errors='replace')[-2000:]}")
    return {"first_step": (first or last) - start, "last_line": last - start, "exit": ended - start,
            "exit_after_last_line": ended - last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", help="folder holding MNIST/raw (torchvision layout)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data = str(Path(args.data_dir).resolve())
    python = sys.executable
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    scripts = {name: work / f"{name}.py" for name in ("plain", "train", "run_api")}
    for name, text in (("plain", PLAIN), ("train", TRAIN), ("run_api", RUN_API)):
        scripts[name].write_text(text)
    train = [python, str(scripts["train"]), "--data-dir", data, "--run-dir", "runs/r"]
    resumed, pycache = work / "resumed", work / "pycache"

    def fresh(argv: list[str]) -> dict[str, float]:
        shutil.rmtree(work / "runs", ignore_errors=True)
        return timeline(argv, work, pycache)

    def resume() -> dict[str, float]:
        shutil.rmtree(resumed, ignore_errors=True)
        resumed.mkdir()
        timeline([*train, "--max-steps", "1"], resumed, pycache)
        return timeline([*train, "--max-steps", "2"], resumed, pycache)

    variants = {
        "import torch": lambda: timeline([python, "-c", "import torch"], work, pycache),
        "plain torch": lambda: timeline([python, str(scripts["plain"]), data], work, pycache),
        "resumable-train": lambda: fresh([*train, "--max-steps", "1"]),
        "resumable-train resume": resume,
        "Run API": lambda: fresh([python, str(scripts["run_api"]), data, "runs/api"]),
    }
    for run in variants.values():  # once unmeasured: the bytecode cache fills
        run()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, run in variants.items():
            results[name].append(run())
    shutil.rmtree(work, ignore_errors=True)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    floor, plain = median("import torch", "exit"), median("plain torch", "first_step")
    print(f"{sys.version.split()[0]}, {os.cpu_count()} CPUs, medians of {args.repeats} (seconds from the start)")
    print(f"{'variant':<24} {'first step':>10} {'- import':>9} {'- plain':>8} {'last line':>10} {'exit':>7} "
          f"{'exit - last line':>17}")
    for name in variants:
        first = median(name, "first_step")
        step = name != "import torch"
        print(f"{name:<24} {first if step else float('nan'):>10.3f} {first - floor if step else float('nan'):>9.3f} "
              f"{first - plain if step else float('nan'):>8.3f} {median(name, 'last_line'):>10.3f} "
              f"{median(name, 'exit'):>7.3f} {median(name, 'exit_after_last_line'):>17.3f}")
    print(f"import torch alone: {floor:.3f} s; plain torch's first step pays {plain - floor:.3f} s after it "
          f"(torch's lazy import of torch._dynamo included)")


if __name__ == "__main__":
    main()
