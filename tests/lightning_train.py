"""A tiny Lightning run for tests/test_lightning.py: an MLP with dropout on 64 synthetic samples, batch 4 (16 steps an
epoch), 40 steps (2.5 epochs), CPU, one thread, a checkpoint every 5 steps. Nothing is downloaded.

    python tests/lightning_train.py DIRPATH [--max-steps 40] [--every 5] [--keep 2] [--time-limit 2s]
                                    [--plain] [--step-sleep S] [--kill-at-step N] [--kill-in-save-at-step N]
                                    [--result FILE] [--drive URL]

Resumes from ``callback.latest_valid()`` and exits with ``callback.exit_code``. ``--plain``: a plain shuffled
``DataLoader`` instead of torchdata's ``StatefulDataLoader``. ``--kill-at-step``/``--kill-in-save-at-step``:
resumable's fault hook SIGKILLs the process right after that step, or inside that step's save (the file written,
the manifest not). ``--result`` writes the per-step metrics (DIRPATH/metrics.jsonl), the final step and the
fingerprint of the final weights as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from resumable import faults
from resumable.checkpoint.format import fingerprint
from resumable.integrations.lightning import ResumableCallback
from resumable.reporting.metrics import read_records


class Points(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return x, x.sum(0, keepdim=True)


class Tiny(L.LightningModule):
    def __init__(self, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.step_sleep = step_sleep

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        self.log("x0", x[0, 0])  # which batch this step trained on
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return loss

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 10, 0.5)]


def loader(plain: bool) -> DataLoader:
    if plain:
        return DataLoader(Points(), batch_size=4, shuffle=True)
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(Points(), batch_size=4, shuffle=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dirpath")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--time-limit", default=None)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--kill-in-save-at-step", type=int, default=None)
    parser.add_argument("--result", default=None)
    parser.add_argument("--drive", default=None)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)  # CPU float reductions depend on the thread count: the same in every run
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    faults.install(faults.Faults(kill_at_step=options.kill_at_step,
                                 kill_in_save_at_step=options.kill_in_save_at_step))
    L.seed_everything(0, verbose=False)
    model = Tiny(options.step_sleep)
    callback = ResumableCallback(options.dirpath, every_n_steps=options.every, keep=options.keep,
                                 time_limit=options.time_limit, drive=options.drive, flush_timeout="60s")
    trainer = L.Trainer(max_steps=options.max_steps, callbacks=[callback], plugins=[callback.checkpoint_io],
                        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    resume = callback.latest_valid()
    print(f"RESUME-FROM {resume}", flush=True)
    trainer.fit(model, loader(options.plain), ckpt_path=resume)
    if options.result:
        with open(options.result, "w", encoding="utf-8") as handle:
            json.dump({"metrics": read_records(callback.dirpath / "metrics.jsonl"), "global_step": trainer.global_step,
                       "fingerprint": fingerprint(model.state_dict(), None)}, handle)
    return callback.exit_code


if __name__ == "__main__":
    sys.exit(main())
