"""Checkpoint format, commit protocol, validation, retention on disk, and load safety."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import replace_bytes, shards

from resumable.checkpoint import CheckpointManager, InvalidCheckpoint, UnsafeCheckpoint, digests, fingerprint
from resumable.checkpoint import format as fmt
from resumable.checkpoint.manifest import seal
from resumable.checkpoint.sharded import META, shard_name
from resumable.errors import StateNotLoadable


def payload(value: float) -> dict:
    model = {"w": torch.full((4, 3), value), "b": torch.zeros(3)}
    optim = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4, 3) * value}}, "param_groups": []}
    return {"model": model, "optimizer": optim, "train_state": {"step": int(value)}}


def save(manager: CheckpointManager, step: int, acc: float | None = None):
    p = payload(float(step))
    return manager.save(step, p, {"epoch": 0, "fingerprint": fingerprint(p["model"], p["optimizer"]),
                                  "metrics": {"test_acc": acc} if acc is not None else {}})


def test_round_trip_and_manifest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    info = save(manager, 7)
    assert info.path.name == "step-000000007"
    manifest = json.loads((info.path / "manifest.json").read_text())
    assert manifest["format_version"] == fmt.FORMAT_VERSION and manifest["step"] == 7
    assert set(manifest["files"]) == {META, shard_name(0)}, "the tensors in one shard, the rest in meta.pt"
    for name, entry in manifest["files"].items():
        path = info.path / name
        tree = {"digest": "sha256-tree"} if name != META else {}  # a shard's sha256 is its tree digest (format 4)
        assert entry == {"size": path.stat().st_size, "sha256": fmt.file_digest(path, entry), **tree}, name
        assert name == META or entry["sha256"] != fmt.sha256_file(path)
    assert {"torch_version", "python_version", "created"} <= set(manifest)
    loaded = manager.load(manager.latest_valid()[0])
    assert torch.equal(loaded["model"]["w"], torch.full((4, 3), 7.0))
    assert digests.of_payload(loaded) == info.fingerprint and info.manifest["fingerprint_version"] == digests.VERSION
    assert not list(tmp_path.rglob("*.tmp-*")), "no temp files after a completed save"


def test_fingerprint_is_order_independent_and_content_sensitive() -> None:
    a = payload(1.0)
    reordered = {"b": a["model"]["b"], "w": a["model"]["w"]}
    assert fingerprint(a["model"], a["optimizer"]) == fingerprint(reordered, a["optimizer"])
    b = payload(1.0)
    b["optimizer"]["state"][0]["exp_avg"][0, 0] += 1e-7
    assert fingerprint(a["model"], a["optimizer"]) != fingerprint(b["model"], b["optimizer"])


def _truncate(d: Path) -> None:
    shard = shards(d)[0]
    data = shard.read_bytes()
    replace_bytes(shard, data[: len(data) // 2])


def _flip(d: Path) -> None:
    shard = shards(d)[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    replace_bytes(shard, bytes(data))


def _truncate_meta(d: Path) -> None:
    data = (d / META).read_bytes()
    (d / META).write_bytes(data[: len(data) // 2])  # meta.pt is always written anew, never linked: in place is safe


def _flip_meta(d: Path) -> None:
    data = bytearray((d / META).read_bytes())
    data[len(data) // 2] ^= 0x01
    (d / META).write_bytes(bytes(data))


def _drop_manifest(d: Path) -> None:
    (d / "manifest.json").unlink()


def _garbage_manifest(d: Path) -> None:
    (d / "manifest.json").write_text("{not json")


def _future_version(d: Path) -> None:
    m = json.loads((d / "manifest.json").read_text())
    m["format_version"] = fmt.FORMAT_VERSION + 1
    (d / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("corrupt, reason", [
    (_truncate, "bytes"), (_flip, "sha256"), (_truncate_meta, "bytes"), (_flip_meta, "sha256"),
    (_drop_manifest, "no manifest"),
    (_garbage_manifest, "unreadable"), (_future_version, "newer"),
])
def test_corrupt_newest_falls_back(tmp_path: Path, corrupt, reason: str) -> None:
    manager = CheckpointManager(tmp_path)
    save(manager, 10)
    newest = save(manager, 20)
    corrupt(newest.path)
    latest, skipped = manager.latest_valid()
    assert latest is not None and latest.step == 10
    assert [s.step for s in skipped] == [20] and reason in skipped[0].reason


def test_cleanup_removes_only_incomplete_saves(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    save(manager, 5)
    incomplete = tmp_path / "step-000000006"
    incomplete.mkdir()
    (incomplete / shard_name(0)).write_bytes(b"partial")  # what a save killed half-way leaves
    leftover = tmp_path / "step-000000005" / f".{shard_name(0)}{fmt.TMP_MARK}123"  # a killed process's temp file
    leftover.write_bytes(b"x")
    flipped = save(manager, 7)
    _flip(flipped.path)  # corrupt but committed: kept for inspection, never silently deleted
    removed = manager.cleanup_incomplete()
    assert incomplete in removed and not incomplete.exists()
    assert not leftover.exists()
    assert flipped.path.exists()
    assert manager.latest_valid()[0].step == 5


def test_resave_of_same_step_replaces_atomically(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    save(manager, 3)
    p = payload(99.0)
    manager.save(3, p, {"fingerprint": fingerprint(p["model"], p["optimizer"])})
    info = manager.latest_valid()[0]
    assert info.step == 3 and info.fingerprint == digests.of_payload(p)


def test_prune_on_disk_across_powers_of_ten(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    for step, acc in [(9, 0.5), (10, 0.99), (11, None), (99, 0.7), (100, None), (101, 0.8)]:
        save(manager, step, acc)
        manager.prune(keep=2, keep_best=True)
    assert [s for s, _ in manager.step_dirs()] == [10, 100, 101]
    manager.prune(keep=2, keep_best=False)
    assert [s for s, _ in manager.step_dirs()] == [100, 101]


class Evil:
    def __reduce__(self):
        import os

        return (os.system, (f"touch {Evil.marker}",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    Evil.marker = marker
    manager = CheckpointManager(tmp_path / "ck")
    with pytest.raises(StateNotLoadable, match="test_checkpoint.Evil"):  # resumable never writes one...
        manager.save(1, {"model": Evil()}, {"fingerprint": "0" * 64})
    info = save(manager, 1)  # ... so plant it: meta.pt replaced, the manifest re-signed for it
    (info.path / META).unlink()
    files = {**info.manifest["files"], META: fmt.write_payload(info.path, {"kind": "x", "tree": {"model": Evil()}},
                                                               META)}
    body = {k: v for k, v in info.manifest.items() if k != "manifest_sha256"}
    fmt.write_json_atomic(info.path / fmt.MANIFEST, seal({**body, "files": files}))
    info = manager.latest_valid()[0]
    assert info.step == 1  # its hashes match: only weights_only protects us
    with pytest.raises(UnsafeCheckpoint, match="refused"):
        manager.load(info)
    assert not marker.exists()


def test_non_dict_payload_is_invalid(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    info = manager.save(1, [torch.zeros(1)], {"fingerprint": "0" * 64})
    with pytest.raises(InvalidCheckpoint, match="not a checkpoint"):
        manager.load(info)
