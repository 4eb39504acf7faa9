"""Frozen tensors are recorded by fingerprint instead of stored; changed ones are stored (issue #11)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import policies

from resumable import Run
from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.engine.state.frozen import FrozenMismatch


class Net(torch.nn.Module):
    """A frozen embedding and a frozen eval-mode batch norm (a backbone), a trained batch norm and head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.backbone_norm = torch.nn.BatchNorm1d(8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 2)
        self.embed.weight.requires_grad_(False)
        self.backbone_norm.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.backbone_norm.eval()  # a frozen backbone keeps its statistics
        return self.head(self.norm(self.backbone_norm(self.embed(tokens).mean(1))))


def _run(run_dir: Path, nudge_at: int | None = None, **options) -> Run:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randint(0, 50, (48, 5)), torch.randint(0, 2, (48,)))
    run = Run(run_dir, model=model, optimizer=optimizer, data=data, batch_size=8, epochs=2,
              **policies(progress=False, checkpoint_steps=2, checkpoint_every=None, **options))
    for _, step, (tokens, labels) in run:
        loss = torch.nn.functional.cross_entropy(model(tokens), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if nudge_at is not None and step == nudge_at:
            with torch.no_grad():  # a script that edits a frozen weight: from now on it must be stored
                model.embed.weight[0].add_(1.0)
    return run


def _manifests(run_dir: Path) -> list[dict]:
    return [info.manifest for info in CheckpointManager(checkpoints_dir(run_dir)).inspect() if info.valid]


def test_frozen_params_and_unchanged_buffers_are_not_stored(tmp_path: Path) -> None:
    _run(tmp_path)
    frozen = _manifests(tmp_path)[-1]["frozen"]
    assert "embed.weight" in frozen and "backbone_norm.weight" in frozen
    assert "backbone_norm.running_mean" in frozen, "a buffer whose bytes never changed"
    assert "norm.running_mean" not in frozen and "norm.weight" not in frozen, "trained or updated: stored"
    assert "head.weight" not in frozen


def test_a_frozen_tensor_changed_in_place_is_stored_from_then_on(tmp_path: Path) -> None:
    _run(tmp_path, nudge_at=3, keep=10)
    by_step = {m["step"]: m for m in _manifests(tmp_path)}
    assert "embed.weight" in by_step[2]["frozen"]
    assert all("embed.weight" not in by_step[s].get("frozen", {}) for s in by_step if s >= 4)


@pytest.mark.parametrize("stop", [2, 5])
def test_resuming_with_frozen_tensors_equals_the_uninterrupted_run(tmp_path: Path, stop: int) -> None:
    _run(tmp_path / "ref", nudge_at=3)
    _run(tmp_path / "run", nudge_at=3, max_steps=stop)
    _run(tmp_path / "run", nudge_at=3)
    assert _manifests(tmp_path / "run")[-1]["fingerprint"] == _manifests(tmp_path / "ref")[-1]["fingerprint"]
    # The nudged weight was loaded from a checkpoint, not built by the script: it must stay stored, or the next
    # start (which builds the un-nudged weight) would be refused as another base.
    assert "embed.weight" not in _manifests(tmp_path / "run")[-1].get("frozen", {})
    _run(tmp_path / "run", nudge_at=3)


def test_another_base_is_refused_before_anything_is_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path, max_steps=4)
    original = Net.__init__

    def other_base(self) -> None:
        original(self)
        with torch.no_grad():
            self.embed.weight[3, 1] += 1

    monkeypatch.setattr(Net, "__init__", other_base)
    with pytest.raises(FrozenMismatch, match="the frozen tensor 'embed.weight' differs"):
        _run(tmp_path)
    assert max(m["step"] for m in _manifests(tmp_path)) == 4, "nothing was trained or written"


def test_export_holds_the_trained_tensors_and_says_the_base_is_not_there(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    from resumable.tools.export import export_model

    _run(tmp_path / "run", max_steps=4)
    export_model(tmp_path / "run", tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert "head.weight" in state and "embed.weight" not in state
    assert "frozen tensor(s) of the model are not in its checkpoints" in caplog.text
    model = Net()
    assert model.load_state_dict(state, strict=False).missing_keys  # the base comes from the script


def test_store_frozen_stores_everything(tmp_path: Path) -> None:
    _run(tmp_path, max_steps=2, store_frozen=True)
    assert "frozen" not in _manifests(tmp_path)[-1]
    _run(tmp_path, max_steps=4)  # the option may change between sessions: from now on the base is left out
    assert "embed.weight" in _manifests(tmp_path)[-1]["frozen"]
