"""Format 3: sharded safetensors payload, bounded staging memory, unchanged shards linked (issue #11)."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from resumable.checkpoint import CheckpointManager, digests
from resumable.checkpoint import format as fmt
from resumable.checkpoint.sharded import META, ShardedFormat, shard_name
from resumable.checkpoint.staging import Staging
from resumable.checkpoint.state_format import Previous, TorchFile
from resumable.config import parse_size


def _trained_state(seed: int = 0) -> dict:
    """A model with a channels_last conv (strided optimizer state), Adam after two steps, odd keys, a complex
    tensor (no safetensors dtype) and plain values."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4))
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
        optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
            "odd": {0: torch.ones(2), "0": torch.zeros(2), "a/b": torch.arange(3)},
            "complex": torch.randn(3, dtype=torch.complex64), "transposed": torch.randn(4, 5).t(),
            "none": None, "count": 7, "ratio": 0.5, "names": ("x", "y"), "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(3, dtype=torch.int64), "half": torch.randn(5).to(torch.bfloat16),
            "flags": torch.tensor([True, False])}


def _assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def test_round_trip_is_exact_with_types_strides_and_metadata(tmp_path: Path) -> None:
    state = _trained_state()
    files = ShardedFormat(shard_size=1000).write(tmp_path, state)
    assert META in files and sum(name.startswith("shard-") for name in files) > 3, files
    back = ShardedFormat().read(tmp_path, {"files": files})
    _assert_same(state, back)
    assert isinstance(back["model"], OrderedDict) and back["model"]._metadata == state["model"]._metadata
    assert back["optimizer"]["state"][0]["step"].dtype == state["optimizer"]["state"][0]["step"].dtype
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    torch.set_rng_state(back["rng"])  # a tensor of its own storage: torch's RNG reads it from the start
    assert digests.of_payload(back) == digests.of_payload(state)


def test_shards_are_safetensors_files_that_the_library_reads(tmp_path: Path) -> None:
    state = {"model": OrderedDict(w=torch.randn(3, 4), b=torch.randn(4).to(torch.float16), i=torch.arange(5))}
    files = ShardedFormat().write(tmp_path, state)
    with safe_open(str(tmp_path / shard_name(0)), "pt") as handle:
        assert sorted(handle.keys()) == ["/model/b", "/model/i", "/model/w"]
        assert torch.equal(handle.get_tensor("/model/w"), state["model"]["w"])
    for name, entry in files.items():
        tree = {"digest": "sha256-tree"} if name != META else {}  # a shard's sha256 is its tree digest (format 4)
        assert entry == {"size": (tmp_path / name).stat().st_size, "sha256": fmt.file_digest(tmp_path / name, entry),
                         **tree}


def test_shard_size_bounds_each_file_and_a_big_tensor_gets_its_own(tmp_path: Path) -> None:
    state = {"model": {f"p{i}": torch.zeros(100) for i in range(10)} | {"big": torch.zeros(1000)}}
    files = ShardedFormat(shard_size=1200).write(tmp_path, state)
    shards = sorted(name for name in files if name.startswith("shard-"))
    assert len(shards) == 5  # 3 + 3 + 3 + 1 small tensors of 400 bytes, then the 4000-byte one alone
    with safe_open(str(tmp_path / shards[-1]), "pt") as handle:
        assert list(handle.keys()) == ["/model/big"]


@pytest.mark.parametrize("budget", [0, 3000, 10**9])
def test_a_state_larger_than_the_staging_memory_saves_identically(tmp_path: Path, budget: int) -> None:
    state = _trained_state()
    (tmp_path / "sync").mkdir()
    reference = ShardedFormat(shard_size=1000).write(tmp_path / "sync", state)  # synchronous: nothing staged
    staging = Staging(budget)
    (tmp_path / "async").mkdir()
    pending = ShardedFormat(shard_size=1000).begin(tmp_path / "async", state, staging=staging)
    total = pending.result.staged + pending.result.direct
    assert staging.allocated <= max(budget, 0) and pending.result.staged <= budget
    if budget == 0:
        assert pending.result.staged == 0 and pending.result.direct > 0
    elif budget == 3000:
        assert 0 < pending.result.staged <= 3000 < total, "part staged, the rest written before save() returns"
    else:
        assert pending.result.direct == 0
    written = pending.finish()
    assert {k: v for k, v in written.files.items() if k != META} == \
        {k: v for k, v in reference.items() if k != META}, "same bytes whatever was staged"
    assert staging.in_use == 0


def test_nothing_changed_after_begin_reaches_the_checkpoint(tmp_path: Path) -> None:
    """pytorch#144657: once the training thread's part returns, mutating the live state changes nothing, for
    staged shards and for those written directly alike."""
    model = torch.nn.Linear(64, 64)
    state = {"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}}
    before = {k: v.clone() for k, v in state["model"].items()}
    staging = Staging(64 * 64 * 4 + 64)  # room for the weight only: the bias is written directly
    pending = ShardedFormat(shard_size=64 * 64 * 4).begin(tmp_path, state, staging=staging)
    assert pending.result.staged and pending.result.direct
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(1.0)
    written = pending.finish()
    back = ShardedFormat().read(tmp_path, {"files": written.files})
    for key, tensor in before.items():
        assert torch.equal(back["model"][key], tensor), key
    assert written.fingerprint == digests.of_payload({"model": before, "optimizer": state["optimizer"]})


def test_unchanged_shards_are_hard_linked_and_survive_pruning(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, ShardedFormat(shard_size=2000))
    frozen = {f"frozen{i}": torch.randn(400) for i in range(3)}
    meta = {"metrics": {}}
    first = manager.save(1, {"model": dict(frozen), "optimizer": {"w": torch.zeros(10)}}, meta)
    second = manager.save(2, {"model": dict(frozen), "optimizer": {"w": torch.ones(10)}}, meta)
    shards = [n for n in first.manifest["files"] if n.startswith("shard-")]
    same = [n for n in shards if first.manifest["files"][n] == second.manifest["files"][n]]
    assert len(same) == len(shards) - 1, "every shard but the one holding the optimizer state is unchanged"
    for name in same:
        assert os.stat(first.path / name).st_ino == os.stat(second.path / name).st_ino
    assert manager.prune(keep=1, keep_best=False) == [1]
    info, skipped = manager.latest_valid()
    assert info.step == 2 and not skipped, "deleting the older checkpoint left the newer one whole"
    assert torch.equal(manager.load(info)["model"]["frozen0"], frozen["frozen0"])


def test_second_save_of_an_unchanged_state_writes_almost_nothing(tmp_path: Path) -> None:
    state = {"model": {f"w{i}": torch.randn(50_000) for i in range(8)}, "optimizer": {}}
    fmt3 = ShardedFormat(shard_size=400_000)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = fmt3.begin(tmp_path / "a", state).finish()
    previous = {n: Previous(tmp_path / "a" / n, e["size"], e["sha256"], e.get("digest"))
                for n, e in first.files.items()}
    second = fmt3.begin(tmp_path / "b", state, previous=previous).finish()
    assert second.linked >= first.written - first.files[META]["size"]
    assert second.written <= 0.01 * first.written, (second.written, first.written)


def test_a_linked_shard_that_changed_meanwhile_is_written_instead(tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(1000)}, "optimizer": {}}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = ShardedFormat().begin(tmp_path / "a", state).finish()
    entry = first.files[shard_name(0)]
    (tmp_path / "a" / shard_name(0)).unlink()  # pruned between the listing and the link
    second = ShardedFormat().begin(tmp_path / "b", state,
                                   previous={shard_name(0): Previous(tmp_path / "a" / shard_name(0), entry["size"],
                                                                     entry["sha256"], entry["digest"])}).finish()
    assert second.linked == 0 and second.files[shard_name(0)] == entry


@pytest.mark.parametrize("damage", ["missing", "truncated", "header"])
def test_a_damaged_shard_falls_back_to_the_previous_checkpoint_with_the_reason(tmp_path: Path, damage: str) -> None:
    manager = CheckpointManager(tmp_path, ShardedFormat(shard_size=1000))
    manager.save(1, _trained_state(1), {})
    newest = manager.save(2, _trained_state(2), {})
    shard = newest.path / shard_name(1)
    data = shard.read_bytes()
    shard.unlink()  # never in place: the file may be linked from another checkpoint
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "header":
        shard.write_bytes(b"\xff" * 8 + data[8:])
    info, skipped = manager.latest_valid()
    assert info.step == 1 and [s.step for s in skipped] == [2]
    assert shard.name in skipped[0].reason, skipped[0].reason


def test_a_hostile_index_is_refused_not_obeyed(tmp_path: Path) -> None:
    files = ShardedFormat().write(tmp_path, {"model": {"w": torch.randn(10)}, "optimizer": {}})
    meta = torch.load(tmp_path / META, weights_only=True)
    cases = {
        "stride past the data": lambda m: m["tensors"][0].__setitem__(3, [10]) or m["tensors"][0].__setitem__(4, [5]),
        "unlisted shard": lambda m: m["tensors"][0].__setitem__(1, "../../etc/passwd"),
        "unknown path": lambda m: m["tensors"][0].__setitem__(0, ["model", "nowhere"]),
        "not an index": lambda m: m.__setitem__("tensors", "x"),
    }
    for what, damage in cases.items():
        bad = json.loads(json.dumps(meta, default=lambda _: None))
        bad["tree"] = meta["tree"]
        damage(bad)
        torch.save(bad, tmp_path / META)
        listed = {**files, META: {"size": 0, "sha256": "0" * 64}}
        with pytest.raises(fmt.InvalidCheckpoint):
            ShardedFormat().read(tmp_path, listed)
        print(what, "refused")


def test_format_2_state_pt_checkpoints_still_load(tmp_path: Path) -> None:
    old = CheckpointManager(tmp_path, TorchFile())
    state = _trained_state()
    info = old.save(3, state, {})
    assert list(info.manifest["files"]) == [fmt.PAYLOAD] and info.manifest.get("fingerprint_version", 1) == 1
    reader = CheckpointManager(tmp_path)  # the default (format 3) manager reads it by its files
    loaded = reader.load(reader.latest_valid()[0])
    _assert_same(state["optimizer"], loaded["optimizer"])
    assert fmt.fingerprint(loaded["model"], loaded["optimizer"]) == info.manifest["fingerprint"]


def test_sizes_parse_like_people_write_them() -> None:
    assert parse_size("256MB") == 256_000_000 and parse_size("2GiB") == 2 << 30 and parse_size("0") == 0
    assert parse_size(" 1.5 gb ") == 1_500_000_000 and parse_size(4096) == 4096
    for bad in ("", "MB", "1.2.3MB", "12 parsecs", "-1MB", "nanMB", "1e400"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_bad_sizes_on_the_command_line_are_usage_errors(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from resumable.cli import train_command

    for option in ("--staging-memory", "--shard-size"):
        result = CliRunner().invoke(train_command, ["--run-dir", str(tmp_path / "run"), option, "12parsecs"])
        assert result.exit_code == 2 and "is not like 256MB" in result.output, result.output
    assert not (tmp_path / "run" / "checkpoints").exists()
