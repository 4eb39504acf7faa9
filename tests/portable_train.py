"""A torchtitan-style loop for tests/test_fsdp.py: its own FSDP2 model, its own loop over a ResumableSampler and its
own DCP checkpoints, with resumable's position, counters and RNG streams in them through ``PortableState``.

    torchrun --standalone --nproc-per-node N tests/portable_train.py RUN_DIR RESULT_JSON [STOP_AFTER_STEP]

A checkpoint every 3 steps into RUN_DIR/step-N, then RUN_DIR/latest names it; STOP_AFTER_STEP ends the process
there (without a save of its own), as a kill would; the next start loads the latest one.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import fsdp_train
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from resumable.engine.data.sampler import ResumableSampler
from resumable.engine.state.portable import PortableState
from resumable.engine.state.train_state import TrainState

EPOCHS, SEED = 2, 3


def main() -> int:
    run_dir, result = Path(sys.argv[1]), sys.argv[2]
    stop_after = int(sys.argv[3]) if len(sys.argv) > 3 else None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = fsdp_train.build(world)
    data = fsdp_train.data()
    state, sampler = TrainState(), ResumableSampler(len(data), 8, SEED, rank=rank, world_size=world)
    portable = PortableState(state, sampler, SEED)
    latest = run_dir / "latest"
    if latest.exists():
        model_state, optimizer_state = get_state_dict(model, optimizer)
        loaded = {"model": model_state, "optim": optimizer_state, "resumable": portable}
        dcp.load(loaded, checkpoint_id=run_dir / latest.read_text())
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    while state.epoch < EPOCHS:
        for index, indices, _size, _last in sampler.walk(state.epoch, state.batch_in_epoch):
            x, y, _ids = data[indices]
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step, state.batch_in_epoch = state.step + 1, index + 1
            if state.step % 3 == 0:
                model_state, optimizer_state = get_state_dict(model, optimizer)
                dcp.save({"model": model_state, "optim": optimizer_state, "resumable": portable},
                         checkpoint_id=run_dir / f"step-{state.step}")
                if rank == 0:
                    latest.write_text(f"step-{state.step}")
                dist.barrier()
            if state.step == stop_after:
                return 3
        state.epoch, state.batch_in_epoch = state.epoch + 1, 0
    found = fsdp_train.digests(model, optimizer)
    if found is not None:
        Path(result).write_text(json.dumps({"fingerprint": found[0], "step": state.step}))
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
