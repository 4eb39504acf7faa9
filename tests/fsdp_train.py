"""An FSDP2 training script for tests/test_fsdp.py: a small MLP sharded with ``fully_shard`` over a CPU (gloo) device
mesh, trained by ``resumable.Run`` on synthetic data; at the end rank 0 writes the sha256 of the gathered model and
optimizer state.

    torchrun --standalone --nproc-per-node N tests/fsdp_train.py RUN_DIR RESULT_JSON [MAX_STEPS]

With ``FSDP_SAMPLES=DIR`` each rank appends the sample ids it trains, per epoch, to ``DIR/<rank>-<pid>.jsonl``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

import resumable

SAMPLES, FEATURES, CLASSES = 192, 16, 4


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank, then sharded
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, CLASSES))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = (x[:, :CLASSES].argmax(dim=1) + (x[:, -1] > 1).long()) % CLASSES
    return TensorDataset(x, y, torch.arange(SAMPLES))


def model_digest(state: dict[str, torch.Tensor]) -> str:
    sha = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        sha.update(name.encode() + tensor.numpy().tobytes())
    return sha.hexdigest()


def digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, str] | None:
    """sha256 of the whole model and optimizer state, and of the model alone (gathered on rank 0; None elsewhere)."""
    model_state, optimizer_state = get_state_dict(model, optimizer,
                                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank():
        return None
    sha = hashlib.sha256(model_digest(model_state).encode())
    for key, state in sorted(optimizer_state["state"].items()):
        for name, value in sorted(state.items()):
            sha.update(f"{key}.{name}".encode() + torch.as_tensor(value).numpy().tobytes())
    return sha.hexdigest(), model_digest(model_state)


def main() -> int:
    run_dir, result = sys.argv[1], sys.argv[2]
    max_steps = int(sys.argv[3]) if len(sys.argv) > 3 else None
    dist.init_process_group("gloo")
    model, optimizer = build(dist.get_world_size())
    run = resumable.Run(run_dir, model=model, optimizer=optimizer, data=data(), batch_size=8, epochs=2, seed=3,
                        checkpointing=resumable.Checkpointing(steps=3, keep=2),
                        session=resumable.Session(max_steps=max_steps),
                        reporting=resumable.Reporting(progress=False, log_every=1))
    log = os.environ.get("FSDP_SAMPLES")
    trained = open(os.path.join(log, f"{dist.get_rank()}-{os.getpid()}.jsonl"), "a") if log else None  # noqa: SIM115
    for epoch, _step, (x, y, ids) in run:
        if trained is not None:
            trained.write(json.dumps({"epoch": epoch, "ids": ids.tolist()}) + "\n")
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.log(loss)
    code = run.exit_code
    if trained is not None:
        trained.close()
    found = digests(model, optimizer)
    if found is not None:
        with open(result, "w") as handle:
            json.dump({"fingerprint": found[0], "model": found[1], "exit_code": code, "resumed_from": run.resumed_from},
                      handle)
    del run, model, optimizer  # the model's and the Run's hold on the process group goes before it is destroyed
    gc.collect()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
