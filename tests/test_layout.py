"""One checkpoint manager for any folder layout (issue #32, item 3): resumable's ``step-N`` and the Trainer's
``checkpoint-N`` folders are committed, checked, pruned, mirrored to Drive and brought back by the same code; a
folder written again while its upload is in flight never reaches Drive with a manifest its files do not match."""

from __future__ import annotations

from pathlib import Path

import pytest

from resumable.checkpoint import CheckpointManager
from resumable.checkpoint import format as fmt
from resumable.checkpoint.layout import ACCELERATE, STEPS, TRAINER, step_of
from resumable.storage.durable import hash_remote, remote_checkpoints
from resumable.storage.mounted import MountedDirStore
from resumable.storage.restore import restore_newest
from resumable.storage.retry import RetryPolicy
from resumable.storage.tiered import Mirror


def trainer_save(store: CheckpointManager, step: int, value: int, run_id: str = "run-a") -> None:
    """What the Trainer does: plain writes into checkpoint-N, then the callback commits them (manifest last)."""
    store.invalidate(step)
    folder = store.folder(step)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(bytes([value % 256]) * 4096)
    (folder / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    store.adopt(step, {"run_id": run_id})


@pytest.mark.parametrize(("layout", "step", "name"),
                         [(STEPS, 1234, "step-000001234"), (TRAINER, 1234, "checkpoint-1234"),
                          (ACCELERATE, 1234, "checkpoint_1234")])
def test_each_layout_names_and_reads_back_its_folders(layout, step: int, name: str) -> None:  # noqa: ANN001
    assert layout.name(step) == name and layout.parse(name) == step and step_of(name) == step


@pytest.mark.parametrize("name", ["checkpoint-", "checkpoint-1.tmp-x", "checkpoint-١٢", "checkpoint-²", "step-12",
                                  "checkpoint-" + "9" * 20, "checkpoints", "runs"])
def test_the_trainer_layout_refuses_what_is_not_one_of_its_folders(name: str) -> None:
    assert TRAINER.parse(name) is None


@pytest.mark.parametrize("name", ["checkpoint_", "checkpoint-12", "checkpoint_1.tmp-x", "checkpoint_١٢", "checkpoints"])
def test_the_accelerate_layout_refuses_what_is_not_one_of_its_folders(name: str) -> None:
    assert ACCELERATE.parse(name) is None


def test_a_trainer_output_dir_is_committed_checked_and_pruned_by_the_checkpoint_manager(tmp_path: Path) -> None:
    store = CheckpointManager(tmp_path, layout=TRAINER)
    for step in (5, 10, 15):
        trainer_save(store, step, step)
    (tmp_path / "step-000000003").mkdir()  # another layout in the same folder is not this store's
    (tmp_path / "runs").mkdir()  # the Trainer's logs
    assert [s for s, _ in store.step_dirs()] == [5, 10, 15]
    info = store.latest_valid()[0]
    assert info.path == tmp_path / "checkpoint-15" and info.manifest["run_id"] == "run-a"
    assert set(info.manifest["files"]) == {"model.safetensors", "trainer_state.json"}
    # A save killed before its commit (older than the newest) and one under way (newer) ...
    (tmp_path / "checkpoint-12").mkdir()
    (tmp_path / "checkpoint-12" / "model.safetensors").write_bytes(b"half")
    (tmp_path / "checkpoint-20").mkdir()
    assert store.prune(keep=1, keep_best=False, protect={5}) == [10, 12]
    # ... the leftover goes with retention, the save under way and the protected one stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-15", "checkpoint-20", "checkpoint-5", "runs",
                                                          "step-000000003"]


def test_a_file_changed_after_the_commit_is_named_and_the_folder_skipped(tmp_path: Path) -> None:
    store = CheckpointManager(tmp_path, layout=TRAINER)
    trainer_save(store, 5, 5)
    trainer_save(store, 10, 10)
    (tmp_path / "checkpoint-10" / "model.safetensors").write_bytes(b"\x00" * 4096)
    chosen, skipped = store.latest_valid()
    assert chosen.step == 5
    assert [i.step for i in skipped] == [10] and "model.safetensors does not match its sha256" in skipped[0].reason


def test_a_folder_inside_a_trainer_checkpoint_is_refused_naming_it(tmp_path: Path) -> None:
    store = CheckpointManager(tmp_path, layout=TRAINER)
    (tmp_path / "checkpoint-5" / "global_step5").mkdir(parents=True)
    with pytest.raises(ValueError, match="global_step5 is a directory"):
        store.adopt(5, {})
    assert not (tmp_path / "checkpoint-5" / fmt.MANIFEST).exists()


def mounted(tmp_path: Path) -> MountedDirStore:
    return MountedDirStore(tmp_path / "drive", RetryPolicy(attempts=2, base_s=0.01), prune_grace_s=0)


def test_trainer_folders_are_mirrored_under_their_own_names_and_brought_back_on_a_fresh_vm(tmp_path: Path) -> None:
    store, remote = CheckpointManager(tmp_path / "out", layout=TRAINER), mounted(tmp_path)
    mirror = Mirror(store, remote, None, print, run_id="run-a")
    for step in (5, 10, 15):
        trainer_save(store, step, step)
        mirror.submit(step)
        mirror.flush(30)
        store.prune(keep=2, keep_best=False, protect=mirror.protected())
    assert mirror.flush(30) == [] and mirror.close(30) and mirror.errors == []
    assert remote.list_checkpoints() == ["checkpoint-10", "checkpoint-15"], "Drive follows the output dir's retention"
    assert not list((tmp_path / "drive").glob("*.jsonl")), "no run logs: the Trainer keeps its own"
    fresh = CheckpointManager(tmp_path / "vm2" / "out", layout=TRAINER)
    assert restore_newest(remote, fresh, None, print) == 15
    info = fresh.latest_valid()[0]
    assert info.path == tmp_path / "vm2" / "out" / "checkpoint-15"
    assert (info.path / "model.safetensors").read_bytes() == bytes([15]) * 4096
    assert sorted(p.name for p in (tmp_path / "vm2" / "out").iterdir()) == ["checkpoint-15"]


class RewritesDuringUpload(MountedDirStore):
    """A mounted Drive folder whose first payload upload of ``step`` happens while the Trainer writes that
    checkpoint again (a resume from an older one: the folder is invalidated, rewritten and committed anew)."""

    def __init__(self, root: Path, store: CheckpointManager, step: int) -> None:
        super().__init__(root, RetryPolicy(attempts=2, base_s=0.01), prune_grace_s=0)
        self.store, self.step, self.fired = store, step, False

    def put_file(self, folder: str, name: str, source: Path):  # noqa: ANN201
        got = super().put_file(folder, name, source)
        if folder == TRAINER.name(self.step) and name == "model.safetensors" and not self.fired:
            self.fired = True
            trainer_save(self.store, self.step, 99)  # the old bytes of model.safetensors are up already
        return got


def test_a_folder_committed_again_during_its_upload_never_reaches_drive_with_the_wrong_manifest(tmp_path: Path) -> None:
    store = CheckpointManager(tmp_path / "out", layout=TRAINER)
    trainer_save(store, 5, 5)
    remote = RewritesDuringUpload(tmp_path / "drive", store, 5)
    mirror = Mirror(store, remote, None, print, run_id="run-a")
    mirror.submit(5)
    mirror.flush(30)
    assert remote.fired
    mirror.submit(5)  # what the new commit does
    assert mirror.flush(30) == [] and mirror.close(30)
    [(step, folder, manifest)] = remote_checkpoints(remote, tmp_path)
    assert manifest == store.latest_valid()[0].manifest, "Drive holds the second commit"
    assert hash_remote(remote, folder, manifest, tmp_path) is None, "every file on Drive matches its manifest"
