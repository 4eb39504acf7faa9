"""The run behind the committed cross-version fixtures in tests/fixtures/ (tests/test_cross_version.py): a tiny
model on generated data, trained by resumable.Run, so any later version of this project can resume a checkpoint
an earlier one wrote and must end where an uninterrupted run ends.

    python tests/compat_train.py tests/fixtures/compat-<version>   # a new fixture: 5 of the 16 steps, committed

Make one whenever the checkpoint format or the package version changes, and keep the old ones.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from resumable import Checkpointing, Reporting, Run, Session


def train(run_dir: Path, max_steps: int | None = None) -> Run:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    run = Run(run_dir, model=model, optimizer=optimizer, scheduler=scheduler, data=data, batch_size=8, epochs=2, seed=7,
              checkpointing=Checkpointing(steps=5, every=None, synchronous=True), session=Session(max_steps=max_steps),
              reporting=Reporting(log_every=1, progress=False))
    for _, _, (x, y) in run:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        run.log(loss)
    return run


def main(target: str) -> None:
    run_dir = Path(target)
    if run_dir.exists():
        sys.exit(f"{run_dir} exists: a fixture is never rewritten (make a new one beside it)")
    train(run_dir, max_steps=5)
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    import resumable
    made_by = {"resumable": getattr(resumable, "__version__", None), "commit": commit, "torch": torch.__version__}
    (run_dir / "made-by.json").write_text(json.dumps(made_by, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
