"""Format 4: one pass over the bytes. A shard's tree digest (16 MiB pieces, hashed while written), fingerprint
version 3 from the same tensor digests, and a resume that hashes each byte once (issue 36, item 3)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from resumable.checkpoint import CheckpointManager, InvalidCheckpoint, digests, shardfile, treehash
from resumable.checkpoint import format as fmt
from resumable.checkpoint import manifest as manifests
from resumable.checkpoint.sharded import META, ShardedFormat
from resumable.engine.state.keeper import StateKeeper
from resumable.engine.state.train_state import TrainState

SMALL_PIECE = 4096  # pieces of 4 KiB, so that small tensors span many of them


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(treehash, "PIECE", SMALL_PIECE)


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 10))
    model[0].weight.data = model[0].weight.data.t().contiguous().t()  # stored flat, rebuilt with its strides
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "empty": torch.zeros(0),
            "extra": {"half": torch.arange(7, dtype=torch.float16), "step": 3}}


def _by_spec(path: Path) -> tuple[str, dict[str, str]]:
    """The tree digest of a shard file computed from its definition, with nothing of resumable but the header parse."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    entries = shardfile.parse_header(data, len(data))
    tensors = {}
    for name, entry in entries.items():  # header order
        pieces = [data[start:min(start + SMALL_PIECE, entry.end)]
                  for start in range(entry.start, entry.end, SMALL_PIECE)]
        tensors[name] = treehash.hashlib.sha256(b"".join(treehash.hashlib.sha256(p).digest() for p in pieces)).digest()
    whole = treehash.hashlib.sha256(b"resumable-tree-1\n" + data[:8 + length] + b"".join(tensors.values()))
    return whole.hexdigest(), {name: raw.hex() for name, raw in tensors.items()}


def test_a_format_4_save_verifies_with_the_tensor_digests_of_its_files(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, ShardedFormat(shard_size=20_000))
    state = _state()
    saved = manager.save(1, state, {})
    assert saved.manifest["format_version"] == 4 and saved.manifest["fingerprint_version"] == digests.VERSION == 3
    shards = {name: entry for name, entry in saved.manifest["files"].items() if name != META}
    assert len(shards) >= 2 and all(entry["digest"] == "sha256-tree" for entry in shards.values())
    assert "digest" not in saved.manifest["files"][META], "meta.pt keeps a plain sha256"
    assert saved.manifest["files"][META]["sha256"] == fmt.sha256_file(saved.path / META)
    info, skipped = manager.latest_valid()
    assert info is not None and not skipped and set(info.digests) == set(shards)
    for name, entry in shards.items():
        whole, tensors = _by_spec(info.path / name)
        assert entry["sha256"] == whole == info.digests[name].digest
        assert info.digests[name].tensors == tensors
    loaded = manager.load(info)
    assert digests.of_payload(loaded) == saved.fingerprint
    assert torch.equal(loaded["model"]["0.weight"], state["model"]["0.weight"])
    assert loaded["model"]["0.weight"].stride() == state["model"]["0.weight"].stride()


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_flipped_byte_in_a_shard_is_caught_by_the_deep_check(tmp_path: Path, where: str) -> None:
    manager = CheckpointManager(tmp_path, ShardedFormat(shard_size=20_000))
    manager.save(1, _state(1), {})
    newest = manager.save(2, _state(2), {})
    shard = next(p for p in sorted(newest.path.iterdir()) if p.name.startswith("shard-"))
    data = bytearray(shard.read_bytes())
    at = len(data) - 5 if where == "data" else 20  # a tensor's last piece, or a character of the JSON header
    data[at] ^= 0x01
    shard.unlink()  # never in place: the file may be linked from another checkpoint
    shard.write_bytes(bytes(data))
    assert manager.check(2, newest.path, deep=False).valid, "the size is right: only the bytes tell"
    info, skipped = manager.latest_valid()
    assert info.step == 1 and [s.step for s in skipped] == [2]
    assert shard.name in skipped[0].reason and "corrupt" in skipped[0].reason, skipped[0].reason


def test_fingerprint_version_3_does_not_depend_on_the_shard_layout(tmp_path: Path) -> None:
    state = _state(3)
    one = CheckpointManager(tmp_path / "one", ShardedFormat()).save(1, state, {})
    many = CheckpointManager(tmp_path / "many", ShardedFormat(shard_size=5_000)).save(1, state, {})
    assert len(many.manifest["files"]) > len(one.manifest["files"]) == 2
    assert one.fingerprint == many.fingerprint == digests.of_payload(state)
    treehash.PIECE = 1 << 20  # (restored by the fixture) other pieces: another digest, so the size is fixed
    assert digests.of_payload(state) != one.fingerprint


class _Holder:
    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def _keeper(root: Path, seed: int) -> tuple[StateKeeper, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    keeper = StateKeeper(CheckpointManager(root, ShardedFormat(shard_size=200_000)),
                         {"model": model, "optimizer": optimizer}, TrainState(), meta={}, keep=3, keep_best=False)
    return keeper, model


class _Count:
    """treehash.sha256 and the piece hash wrapped: every byte hashed, and every byte hashed as a piece."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.all = self.pieces = 0
        self._lock = threading.Lock()
        real_sha, real_piece = treehash.sha256, treehash._piece
        count = self

        class Counted:
            def __init__(self, data: object = b"") -> None:
                self._hash = real_sha()
                self.update(data)

            def update(self, data: object) -> None:
                with count._lock:
                    count.all += memoryview(data).nbytes
                self._hash.update(data)

            def digest(self) -> bytes:
                return self._hash.digest()

            def hexdigest(self) -> str:
                return self._hash.hexdigest()

        def piece(view: memoryview) -> bytes:
            with count._lock:
                count.pieces += view.nbytes
            return real_piece(view)

        monkeypatch.setattr(treehash, "sha256", Counted)
        monkeypatch.setattr(treehash, "_piece", piece)

    def reset(self) -> None:
        self.all = self.pieces = 0


def _tensor_bytes(step_dir: Path) -> int:
    total = 0
    for path in step_dir.glob("shard-*"):
        data = path.read_bytes()
        total += sum(e.end - e.start for e in shardfile.parse_header(data, len(data)).values())
    return total


def test_a_save_and_a_resume_each_hash_every_byte_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counted = _Count(monkeypatch)
    keeper, _ = _keeper(tmp_path, 4)
    keeper.save("test", wait=True)  # nothing to link to: every shard written and hashed on the way
    saved_pieces, saved_all = counted.pieces, counted.all
    info = keeper.manager.latest_valid()[0]
    state = _tensor_bytes(info.path)
    assert state > 3 * 256 * 256 * 4, "the model and both Adam moments are in the shards"
    extra = (info.path / META).stat().st_size + 64 * 1024  # meta.pt, the headers, digests of digests, the lines
    assert saved_pieces == state and state <= saved_all <= state + extra, (saved_pieces, saved_all, state)

    resumer, model = _keeper(tmp_path, 5)
    counted.reset()
    found, skipped = resumer.manager.latest_valid()
    resumer.restore(found)
    assert found.step == 0 and not skipped
    assert counted.pieces == state and state <= counted.all <= state + extra, (counted.pieces, counted.all, state)
    assert torch.equal(model.weight, keeper.objects["model"].weight)

    counted.reset()  # not verified in this process: the fingerprint hashes the loaded tensors (once) instead
    unverified = resumer.manager.check(found.step, found.path, deep=False)
    resumer.restore(unverified)
    covered = sum(t.numel() * t.element_size() for t in (*model.state_dict().values(),
                  *(v for s in resumer.objects["optimizer"].state_dict()["state"].values() for v in s.values())))
    assert counted.pieces == covered, (counted.pieces, covered)


def test_a_shard_changed_after_the_deep_check_is_not_trusted_by_the_resume(tmp_path: Path) -> None:
    keeper, _ = _keeper(tmp_path, 6)
    keeper.save("test", wait=True)
    resumer, _ = _keeper(tmp_path, 7)
    info = resumer.manager.latest_valid()[0]
    shard = next(p for p in sorted(info.path.iterdir()) if p.name.startswith("shard-"))
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.unlink()
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(InvalidCheckpoint, match="fingerprint"):
        resumer.restore(info)


def _reseal(step_dir: Path, change) -> None:  # noqa: ANN001 - a function of the manifest
    body = json.loads((step_dir / fmt.MANIFEST).read_text())
    change(body)
    (step_dir / fmt.MANIFEST).write_text(json.dumps(manifests.seal(body)))


def test_an_unknown_digest_is_refused_as_written_by_a_newer_resumable(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    info = manager.save(1, _state(), {})
    shard = next(name for name in info.manifest["files"] if name != META)
    _reseal(info.path, lambda body: body["files"][shard].__setitem__("digest", "blake3-tree"))
    with pytest.raises(InvalidCheckpoint, match="written by a newer resumable") as caught:
        manifests.read(info.path)
    assert "blake3-tree" in str(caught.value)
    found = manager.check(1, info.path)
    assert not found.valid and "blake3-tree" in found.reason


def test_a_tree_digest_on_a_file_that_is_not_a_shard_is_corruption(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    info = manager.save(1, _state(), {})
    _reseal(info.path, lambda body: body["files"][META].__setitem__("digest", "sha256-tree"))
    found = manager.check(1, info.path)
    assert not found.valid and META in found.reason and "corrupt" in found.reason


FIXTURE = Path(__file__).parent / "fixtures" / "compat-0.1.0" / "checkpoints"


def test_a_format_3_checkpoint_still_verifies_with_its_plain_digests(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path / "checkpoints")
    manager = CheckpointManager(tmp_path / "checkpoints")
    info, skipped = manager.latest_valid()
    assert info is not None and not skipped and info.format_version == 3 and info.digests == {}
    assert info.manifest["fingerprint_version"] == digests.TENSOR_VERSION
    assert digests.of_payload(manager.load(info), digests.TENSOR_VERSION) == info.fingerprint


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the bounce buffer of a direct write)")
def test_a_cuda_state_larger_than_the_bounce_buffer_hashes_like_its_copy(tmp_path: Path) -> None:
    treehash.PIECE = 16 << 20  # the real size: 64 MB bounce chunks hold four pieces
    big = torch.randn(40 << 20, device="cuda")  # 160 MB: three chunks through the bounce buffer
    state = {"model": {"w": big, "b": torch.randn(3, device="cuda")}, "optimizer": {}}
    info = CheckpointManager(tmp_path).save(1, state, {})
    checked = CheckpointManager(tmp_path).latest_valid()[0]
    assert checked is not None and checked.step == 1
    cpu = {"model": {k: v.cpu() for k, v in state["model"].items()}, "optimizer": {}}
    assert info.fingerprint == digests.of_payload(cpu) == digests.of_payload(state)


def test_piece_digests_cover_views_in_order() -> None:
    data = bytes(range(256)) * 100  # 25,600 bytes: six full pieces and a part
    whole = treehash.TensorHash()
    whole.add(memoryview(data))
    split = treehash.TensorHash()
    split.add(memoryview(data)[:2 * SMALL_PIECE])
    split.add(memoryview(data)[2 * SMALL_PIECE:])
    assert whole.digest() == split.digest() != treehash.TensorHash().digest() == treehash.EMPTY


def test_hashing_leaves_no_thread_that_holds_the_process_open(tmp_path: Path) -> None:
    """A save and a deep check on the main thread start the hashing workers here; resumable-train leaves the process
    at once only when no non-daemon thread is alive (cli/exits.exit_now), so they must be daemons (a resumed run
    paid ~0.9 s of interpreter teardown at exit while they were a ThreadPoolExecutor's)."""
    manager = CheckpointManager(tmp_path, ShardedFormat(shard_size=20_000))
    saved = manager.save(1, _state(), {})
    assert manager.check(1, saved.path, deep=True).valid
    holding = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()
               and not t.daemon]
    assert holding == []
    assert any(t.name.startswith("resumable-digest") for t in threading.enumerate())


def test_a_forked_child_hashes_with_workers_of_its_own(tmp_path: Path) -> None:
    """Only the forking thread survives a fork: a child (a DataLoader worker, a multiprocessing fork) that hashes
    starts its own workers instead of waiting forever on the parent's."""
    manager = CheckpointManager(tmp_path, ShardedFormat(shard_size=20_000))
    saved = manager.save(1, _state(), {})
    assert manager.check(1, saved.path, deep=True).valid  # the workers exist in this process
    child = os.fork()
    if child == 0:
        try:
            os._exit(0 if manager.check(1, saved.path, deep=True).valid else 1)
        finally:
            os._exit(2)
    deadline = 30.0
    while deadline > 0:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
        deadline -= 0.05
    os.kill(child, 9)
    pytest.fail("the forked child's deep check hung on the parent's hashing workers")


def test_a_file_system_that_cannot_map_files_is_hashed_by_reading(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Some FUSE mounts (a Drive folder with direct I/O) refuse mmap: the deep check reads the pieces instead and
    finds the same digests."""
    manager = CheckpointManager(tmp_path, ShardedFormat(shard_size=20_000))
    saved = manager.save(1, _state(), {})
    shard = next(p for p in sorted(saved.path.iterdir()) if p.suffix == ".safetensors")
    mapped = shardfile.digest_file(shard)

    def refuse(*args: object, **kwargs: object) -> object:
        raise OSError(19, "No such device")

    monkeypatch.setattr(shardfile.mmap, "mmap", refuse)
    read = shardfile.digest_file(shard)
    assert (read.digest, read.tensors) == (mapped.digest, mapped.tensors) == _by_spec(shard)
    assert manager.check(1, saved.path, deep=True).valid
