"""Issue #17, hardening: what resumable reads back may be damaged or hostile (GUIDE 13).

One test per class, each over several cases:
- the path policy: names from a manifest or from Drive are plain names, symlinks are never followed when
  deleting, ``export --out`` never lands in the checkpoints or on a node that is not a regular file;
- hostile files never hang a command: an absolute name in a manifest (/dev/zero, /etc/hostname), a FIFO named
  meta.pt (the file torch.load reads) and a pickle memo bomb each end within a bound, report the checkpoint
  invalid and fall back;
- a payload's structure is measured as a tree before anything walks it, and loading has a time bound.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import payload_files, run, shards

from resumable.checkpoint import CheckpointManager, InvalidCheckpoint, checkpoints_dir, fingerprint
from resumable.checkpoint import format as fmt
from resumable.checkpoint.layout import STEPS
from resumable.checkpoint.sharded import KIND, META

# Generous for a loaded CI machine, far below "forever"; RESUMABLE_TEST_HANG_S lowers it to check old code fast.
HANG_S = float(os.environ.get("RESUMABLE_TEST_HANG_S", "60"))
TRAIN = ["--batch-size", "16", "--checkpoint-steps", "2", "--keep", "5", "--no-progress", "--no-download"]
EMPTY_SHA = hashlib.sha256(b"").hexdigest()


# -- helpers ---------------------------------------------------------------------------------------------
def _step(root: Path, step: int) -> Path:
    return checkpoints_dir(root) / STEPS.name(step)


def _rewrite_manifest(directory: Path, change) -> None:  # noqa: ANN001 - a function of the manifest dict
    """Edit a manifest as an attacker with write access would: valid JSON, and re-sealed when the format seals
    it (so the damage reaches the checks after the seal, not only the seal)."""
    path = directory / fmt.MANIFEST
    body = json.loads(path.read_text())
    change(body)
    if "manifest_sha256" in body:
        from resumable.checkpoint.manifest import seal

        body = seal(body)
    path.write_text(json.dumps(body, indent=2, sort_keys=True))


def _snapshot(root: Path) -> dict[str, Any]:
    """Everything under ``root`` (without following links): kind and content hash, to prove nothing changed."""
    found: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode):
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISLNK(mode):
                found[str(path)] = f"link:{os.readlink(path)}"
            else:
                found[str(path)] = stat.S_IFMT(mode)
    return found


def _small_checkpoints(root: Path, steps: list[int]) -> CheckpointManager:
    manager = CheckpointManager(checkpoints_dir(root))
    for step in steps:
        model = {"w": torch.full((8,), float(step))}
        manager.save(step, {"model": model, "optimizer": {}, "train_state": {"step": step}},
                     {"fingerprint": fingerprint(model, {}), "epoch": 0, "metrics": {"test_acc": step / 100}})
    return manager


# -- 1. the path policy ------------------------------------------------------------------------------------
def test_path_policy_manifest_names(tmp_path: Path) -> None:
    """Absolute and ``..`` names in a manifest are refused, even when they would verify."""
    run_dir, outside = tmp_path / "run", tmp_path / "outside.txt"
    outside.write_bytes(b"someone else's file\n")
    manager = _small_checkpoints(run_dir, [1, 2, 3])
    entry = {"size": outside.stat().st_size, "sha256": hashlib.sha256(outside.read_bytes()).hexdigest()}
    hostname = Path("/etc/hostname")  # an absolute name of a file that exists, with its true size and sha256
    absolute = {"size": hostname.stat().st_size, "sha256": hashlib.sha256(hostname.read_bytes()).hexdigest()}
    hostile = {2: ("../../../outside.txt", entry), 3: (str(hostname), absolute)}  # both would verify
    for step, (name, listed) in hostile.items():
        _rewrite_manifest(_step(run_dir, step), lambda body, n=name, e=listed: body["files"].__setitem__(n, e))
    hostile = {step: name for step, (name, _) in hostile.items()}
    for step, name in hostile.items():
        info = manager.check(step, _step(run_dir, step))
        assert not info.valid and name in str(info.reason), (name, info.reason)
    latest, skipped = manager.latest_valid()
    assert latest is not None and latest.step == 1 and [i.step for i in skipped] == [3, 2]
    # verify_files itself refuses them too, for a manifest that did not come through manifest.read (Drive)
    for name in (*hostile.values(), "", ".", "a/b", "a\0b"):
        with pytest.raises(InvalidCheckpoint):
            fmt.verify_files(_step(run_dir, 1), {"files": {name: entry}})


def _upload(store: Any, folder: str, name: str, source: Path, rename_to: str | None = None,
            fake: Any = None) -> None:
    store.put_file(folder, name, source)
    if rename_to is not None:  # a title that only another Drive client (or a hostile one) would write
        with fake.lock:
            [f for f in fake.files.values() if f.title == name][0].title = rename_to


def test_path_policy_drive_names(tmp_path: Path) -> None:
    """The loopback Drive: a manifest naming ``../../../escape.txt`` (present under that title) and a TensorBoard
    event file titled ``../../tb-escape``: nothing is written outside the local cache, the older checkpoint is
    restored, the remote one is reported invalid with its reason."""
    from fakedrive import FakeDrive, make_drive

    from resumable.storage.gdrive import DriveLocation, GDriveStore
    from resumable.storage.retry import RetryPolicy
    from resumable.storage.tiered import describe_remote, restore_newest

    source = tmp_path / "source"
    _small_checkpoints(source, [1, 2])
    evil = tmp_path / "evil.txt"
    evil.write_bytes(b"written outside the cache\n")
    cache = tmp_path / "cache" / "run"
    escape, tb_escape = tmp_path / "cache" / "escape.txt", tmp_path / "cache" / "tb-escape"
    entry = {"size": evil.stat().st_size, "sha256": hashlib.sha256(evil.read_bytes()).hexdigest()}
    _rewrite_manifest(_step(source, 2), lambda body: body["files"].__setitem__("../../../escape.txt", entry))
    with FakeDrive() as fake:
        store = GDriveStore(make_drive(fake), DriveLocation.parse("gdrive://root/runs/t"),
                            RetryPolicy(attempts=3, base_s=0.01))
        for step in (1, 2):
            folder = STEPS.name(step)
            for payload in payload_files(_step(source, step)):  # meta.pt and the shards
                _upload(store, folder, payload.name, payload)
            if step == 2:
                _upload(store, folder, "evil", evil, "../../../escape.txt", fake)
            _upload(store, folder, fmt.MANIFEST, _step(source, step) / fmt.MANIFEST)
        _upload(store, "tensorboard", "events.out.tfevents.1", evil)
        _upload(store, "tensorboard", "tb", evil, "../../tb-escape", fake)
        said: list[str] = []
        restored = restore_newest(store, CheckpointManager(checkpoints_dir(cache)), cache, said.append)
        entries = describe_remote(store, tmp_path)
        board = store.list_files("tensorboard")
    assert not escape.exists() and not tb_escape.exists(), said
    assert restored == 1, said
    assert (cache / "tensorboard" / "events.out.tfevents.1").is_file()
    bad = [e for e in entries if e["step"] == 2][0]
    assert not bad["valid"] and "escape.txt" in bad["reason"], bad
    assert sorted(board) == ["events.out.tfevents.1"], board  # the hostile title is not listed at all


def test_path_policy_mounted_links(tmp_path: Path) -> None:
    """A mounted Drive folder (MountedDirStore on a tmp folder) with a symlinked step folder and payload files
    (meta.pt, shards) that are symlinks: none is listed, so nothing outside the mount is read; the real checkpoint
    is restored."""
    from resumable.storage.mounted import MountedDirStore
    from resumable.storage.tiered import restore_newest

    mount, elsewhere = tmp_path / "mount", tmp_path / "elsewhere"
    _small_checkpoints(mount, [1])
    _small_checkpoints(elsewhere, [3, 4])
    os.symlink(_step(elsewhere, 3), _step(mount, 3))
    (_step(mount, 4)).mkdir()
    shutil.copy(_step(elsewhere, 4) / fmt.MANIFEST, _step(mount, 4) / fmt.MANIFEST)
    linked = [payload.name for payload in payload_files(_step(elsewhere, 4))]
    assert META in linked and len(linked) > 1
    for name in linked:
        os.symlink(_step(elsewhere, 4) / name, _step(mount, 4) / name)
    store = MountedDirStore(mount, prune_grace_s=0)
    assert not set(linked) & set(store.list_files(STEPS.name(4)))
    assert STEPS.name(3) not in store.list_checkpoints()
    cache = tmp_path / "cache"
    said: list[str] = []
    assert restore_newest(store, CheckpointManager(checkpoints_dir(cache)), cache, said.append) == 1, said


def test_path_policy_symlinked_step_dirs(tmp_path: Path) -> None:
    """Retention, cleanup of unfinished saves and --fresh --overwrite with step dirs (and the TensorBoard dir)
    that are symlinks to folders outside the run dir: only the links go, nothing outside changes."""
    from resumable.engine.rundir.run_dir import RunDir
    from resumable.storage import RunLocation

    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    manager = _small_checkpoints(run_dir, [2, 3, 4])
    _small_checkpoints(outside, [0])  # a valid checkpoint elsewhere, linked in as the oldest step
    unfinished = outside / "unfinished"
    unfinished.mkdir()
    (unfinished / ".state.pt.tmp-1").write_bytes(b"a user's file")
    (outside / "board").mkdir()
    (outside / "board" / "events").write_bytes(b"keep")
    os.symlink(_step(outside, 0), _step(run_dir, 0))
    os.symlink(unfinished, _step(run_dir, 1))
    os.symlink(outside / "board", run_dir / "tensorboard")
    before = _snapshot(outside)

    assert [s for s, _ in manager.step_dirs()] == [2, 3, 4]  # links are not checkpoints
    assert manager.prune(keep=1, keep_best=False) == [2, 3]
    assert _snapshot(outside) == before
    removed = manager.cleanup_incomplete()
    assert set(removed) == {_step(run_dir, 0), _step(run_dir, 1)} and not os.path.lexists(_step(run_dir, 0))
    assert _snapshot(outside) == before
    os.symlink(_step(outside, 0), _step(run_dir, 0))  # again, for --fresh --overwrite
    RunDir("run", RunLocation(run_dir, None)).reset()
    assert _snapshot(outside) == before
    assert not os.path.lexists(run_dir / "tensorboard") and list(checkpoints_dir(run_dir).iterdir()) == []
    from resumable.checkpoint import paths

    link = tmp_path / "link"
    os.symlink(outside, link)
    with pytest.raises(paths.UnsafePath, match="symbolic link"):
        paths.remove_tree(link)
    assert _snapshot(outside) == before


def test_path_policy_export_out(tmp_path: Path) -> None:
    """``export --out`` inside checkpoints/ (directly, or through a link) and onto an existing node that is not a
    regular file: exit 2, nothing written, nothing replaced."""
    from resumable.tools.export import export_command

    run_dir = tmp_path / "run"
    _small_checkpoints(run_dir, [1, 2])
    fifo, device, folder, link = tmp_path / "fifo", tmp_path / "null", tmp_path / "folder", tmp_path / "link.pt"
    os.mkfifo(fifo)
    folder.mkdir()
    os.symlink(_step(run_dir, 2) / META, link)
    targets = [_step(run_dir, 2) / META, shards(_step(run_dir, 2))[0], checkpoints_dir(run_dir) / "model.pt", link,
               fifo, folder]
    try:
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
        targets.append(device)
    except PermissionError:
        pass  # not root: the FIFO stands for the nodes
    before = {**_snapshot(run_dir), **_snapshot(tmp_path)}
    for out in targets:
        result = CliRunner().invoke(export_command, [str(run_dir), "--out", str(out)])
        assert result.exit_code == 2, (out, result.output)
        assert result.output.startswith("error: --out ") and result.output.count("\n") == 1, result.output
    assert {**_snapshot(run_dir), **_snapshot(tmp_path)} == before
    manager = CheckpointManager(checkpoints_dir(run_dir))
    assert all(info.valid for info in manager.inspect())


# -- 2. hostile files never hang ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tiny_mnist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run dir with checkpoints at steps 2, 4 and 6."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    done = run(["--run-dir", str(run_dir), "--data-dir", str(tiny_mnist), "--max-steps", "6", *TRAIN])
    assert done.returncode == 0, done.stderr
    return run_dir


def _memo_bomb(levels: int = 60) -> list:
    """1 KB pickled, 2^levels leaves when walked: every level references the one below twice."""
    leaf: list = []
    for _ in range(levels):
        leaf = [leaf, leaf]
    return leaf


def _damage(step_dir: Path, how: str) -> str:
    """Damage the checkpoint in ``step_dir``; returns a substring its reason must contain."""
    if how in ("dev-zero", "etc-hostname"):
        target = Path("/dev/zero" if how == "dev-zero" else "/etc/hostname")
        entry = {"size": 0, "sha256": EMPTY_SHA} if how == "dev-zero" else \
            {"size": target.stat().st_size, "sha256": hashlib.sha256(target.read_bytes()).hexdigest()}
        _rewrite_manifest(step_dir, lambda body: body["files"].__setitem__(str(target), entry))
        return str(target)
    if how == "fifo":  # instead of meta.pt, the file torch.load reads
        (step_dir / META).unlink()
        os.mkfifo(step_dir / META)
        _rewrite_manifest(step_dir, lambda body: body["files"].__setitem__(META, {"size": 0, "sha256": EMPTY_SHA}))
        return "FIFO"
    assert how == "memo-bomb"
    meta = torch.load(step_dir / META, weights_only=True)
    meta["tree"]["model"]["bomb"] = _memo_bomb()
    torch.save(meta, step_dir / META)  # meta.pt is never hard-linked to another checkpoint's: rewritten in place
    data = (step_dir / META).read_bytes()
    entry = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}  # it verifies: only its shape is bad
    _rewrite_manifest(step_dir, lambda body: body["files"].__setitem__(META, entry))
    return "payload structure"


def _bounded(args: list[str], name: str = "resumable") -> subprocess.CompletedProcess | None:
    """Run a command with the hang bound; None when it had to be killed (every command runs, then the test
    says which ones hung)."""
    try:
        return run(args, name=name, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        return None


# dev-zero and etc-hostname run in the soak set (about 8 s each): fifo takes the same regular-files-only open as
# dev-zero, and the paths a manifest may name are checked in-process (test_hardening_paths' manifest tests).
@pytest.mark.parametrize("how", [pytest.param("dev-zero", marks=pytest.mark.soak),
                                 pytest.param("etc-hostname", marks=pytest.mark.soak), "fifo", "memo-bomb"])
def test_hostile_checkpoint_ends_quickly_and_falls_back(how: str, trained: Path, tiny_mnist: Path,
                                                        tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "model.pt"
    shutil.copytree(trained, run_dir, symlinks=True)
    reason = _damage(_step(run_dir, 6), how)
    readers = {"verify": ["verify", str(run_dir)], "inspect": ["inspect", "--json", str(run_dir)],
               "export": ["export", str(run_dir), "--out", str(out)]}
    with ThreadPoolExecutor(len(readers)) as pool:  # they only read the run dir: at the same time
        done = dict(zip(readers, pool.map(_bounded, readers.values()), strict=True))
    done["resume"] = _bounded(["--run-dir", str(run_dir), "--data-dir", str(tiny_mnist), "--max-steps", "8", *TRAIN],
                              name="resumable-train")  # last: it rewrites the run dir
    hung = [command for command, result in done.items() if result is None]
    assert not hung, f"{hung} did not end within {HANG_S:.0f}s (killed)"
    verify, inspect, export, resume = done.values()

    assert verify.returncode in (0, 1) and inspect.returncode == 0, (verify.stderr, inspect.stderr)
    if how != "memo-bomb":  # its sha256 is right: only loading it can tell, and inspect/verify do not load
        newest = [c for c in json.loads(inspect.stdout)["checkpoints"] if c["step"] == 6][0]
        assert not newest["valid"] and reason in newest["reason"], newest
        assert json.loads(inspect.stdout)["latest_valid"]["step"] == 4
        assert "step 6" in verify.stdout and reason in verify.stdout, verify.stdout
    else:
        assert f"checkpoint 6 is invalid: {reason}" in export.stderr.replace(f"{META}: ", ""), export.stderr
    assert export.returncode == 0 and "step 4 " in export.stdout and out.is_file(), export.stdout + export.stderr

    assert resume.returncode == 0, resume.stderr
    assert "skipping checkpoint step 6" in resume.stderr and reason in resume.stderr, resume.stderr
    latest, _ = CheckpointManager(checkpoints_dir(run_dir)).latest_valid()
    assert latest is not None and latest.step == 8


# -- 3. the payload's structure is checked before it is walked ---------------------------------------------
def _structure_bomb(kind: str) -> Any:
    if kind == "list-bomb":
        return {"model": {"w": torch.zeros(2), "x": _memo_bomb()}}
    if kind == "dict-bomb":
        node: Any = {}
        for _ in range(60):
            node = {"a": node, "b": node}
        return {"model": {}, "optimizer": node}
    if kind == "tuple-bomb":
        node = ()
        for _ in range(60):
            node = (node, node)
        return {"model": {"t": node}}
    if kind == "cycle":
        loop: list = []
        loop.append(loop)
        return {"model": {"loop": loop}}
    assert kind == "deep"
    deep: list = []
    for _ in range(200):  # deeper than MAX_DEPTH (100), within what torch.save can pickle
        deep = [deep]
    return {"model": {"deep": deep}}


def _hostile_meta(manager: CheckpointManager, step: int, state: Any):  # noqa: ANN202 - a CheckpointInfo
    """A committed format 3 checkpoint whose meta.pt (the file torch.load reads) holds ``state`` as its tree, its
    tensors inline, with a consistent manifest: only the structure is wrong. (resumable's writer walks the state
    as a tree, so it cannot write a memo bomb or a cycle itself: the file is made here as an attacker would.)"""
    directory = manager.begin(step)
    entry = fmt.write_payload(directory, {"kind": KIND, "tree": state, "tensors": []}, META)
    return manager.commit(step, {META: entry}, {"fingerprint": "0" * 64})


@pytest.mark.parametrize("case", ["list-bomb", "dict-bomb", "tuple-bomb", "cycle", "deep", "shared-ok",
                                  "time-bound"])
def test_payload_structure_checked_before_walk(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = CheckpointManager(checkpoints_dir(tmp_path))
    if case == "shared-ok":
        from resumable.checkpoint.state_format import TorchFile, check_structure

        # What real checkpoints hold: a synchronous save shares the RNG dict between "rng" and "ranks", and Adam's
        # param groups share one betas tuple. Sharing is fine; only the size of a walk is bounded.
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.Adam([{"params": [model.weight]}, {"params": [model.bias]}])
        rng = {"torch": torch.get_rng_state()}
        payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng,
                   "ranks": [{"rng": rng}]}
        assert check_structure(payload) < 100
        # state.pt (formats 1 and 2) keeps the sharing through torch.save, and reading it back accepts it
        old = CheckpointManager(checkpoints_dir(tmp_path / "old"), state_format=TorchFile())
        info = old.save(1, payload, {"fingerprint": fingerprint(payload["model"], payload["optimizer"])})
        loaded = old.load(info)
        assert loaded["ranks"][0]["rng"] is loaded["rng"]  # the sharing survived the round trip
        assert check_structure(loaded) < 100
        # format 3 writes the state as a tree (meta.pt shares nothing): the same values come back at both places
        info = manager.save(1, payload, {})
        loaded = manager.load(info)
        assert torch.equal(loaded["ranks"][0]["rng"]["torch"], loaded["rng"]["torch"])
        assert check_structure(loaded) < 100
        return
    if case == "time-bound":
        from resumable.checkpoint.sharded import ShardedFormat
        from resumable.checkpoint.state_format import TorchFile

        old = CheckpointManager(checkpoints_dir(tmp_path / "old"), state_format=TorchFile())  # format 1/2 state.pt
        info = old.save(1, {"model": {"w": torch.zeros(4)}}, {})
        with pytest.raises(InvalidCheckpoint, match=r"longer than .* \(on state\.pt"):
            TorchFile(load_timeout_s=1e-9).read(info.path, info.manifest or {})
        info = manager.save(1, {"model": {"w": torch.zeros(4)}}, {})  # format 3: meta.pt is read first
        with pytest.raises(InvalidCheckpoint, match=r"longer than .* \(on meta\.pt"):
            ShardedFormat(load_timeout_s=1e-9).read(info.path, info.manifest or {})
        monkeypatch.setenv("RESUMABLE_LOAD_TIMEOUT_S", "nan")
        with pytest.raises(ValueError, match="RESUMABLE_LOAD_TIMEOUT_S='nan'"):
            TorchFile()
        with pytest.raises(ValueError, match="RESUMABLE_LOAD_TIMEOUT_S='nan'"):
            ShardedFormat()
        return
    info = _hostile_meta(manager, 1, _structure_bomb(case))
    assert (info.path / META).stat().st_size < 200_000
    started = time.monotonic()
    with pytest.raises(InvalidCheckpoint, match="payload structure"):
        manager.load(info)
    assert time.monotonic() - started < 10
