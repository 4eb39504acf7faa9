from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchvision import datasets, transforms

from resumable.tasks import mnist


def test_tiny_idx_loads_through_torchvision_and_matches_guide_transform(tiny_mnist: Path) -> None:
    data = mnist.load_mnist(tiny_mnist, torch.device("cpu"), download=False)
    assert data.train.images.shape == (96, 1, 28, 28)
    assert data.test.images.shape == (40, 1, 28, 28)
    assert data.train.labels.dtype == torch.int64
    guide = datasets.MNIST(str(tiny_mnist), train=True, download=False,
                           transform=transforms.Compose([transforms.ToTensor(),
                                                         transforms.Normalize((0.1307,), (0.3081,))]))
    for i in (0, 17, 95):
        image, label = guide[i]
        assert torch.equal(data.train.images[i], image), "normalisation must match ToTensor+Normalize bit for bit"
        assert data.train.labels[i].item() == label


def test_identity_depends_on_content(tiny_mnist: Path, tmp_path: Path) -> None:
    from conftest import make_tiny_mnist

    other = make_tiny_mnist(tmp_path / "other", seed=1)
    a = mnist.load_mnist(tiny_mnist, torch.device("cpu"), download=False).identity
    b = mnist.load_mnist(other, torch.device("cpu"), download=False).identity
    assert a["train_size"] == b["train_size"] and a["sha256"] != b["sha256"]


def test_missing_files_without_download_names_location(tmp_path: Path) -> None:
    with pytest.raises(mnist.DataUnavailable) as err:
        mnist.load_mnist(tmp_path, torch.device("cpu"), download=False)
    message = str(err.value)
    assert str(tmp_path / "MNIST" / "raw") in message and "--data-dir" in message


def test_failed_download_is_data_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Port 1 on loopback refuses at once: a download that fails without touching the network.
    monkeypatch.setattr(datasets.MNIST, "mirrors", ["http://127.0.0.1:1/"])
    with pytest.raises(mnist.DataUnavailable) as err:
        mnist.load_mnist(tmp_path, torch.device("cpu"), download=True)
    assert "download failed" in str(err.value)


def test_gzipped_files_load_the_same(tiny_mnist: Path, tmp_path: Path) -> None:
    import gzip

    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in mnist.RAW_FILES:
        (raw / f"{name}.gz").write_bytes(gzip.compress((tiny_mnist / "MNIST" / "raw" / name).read_bytes()))
    a = mnist.load_mnist(tiny_mnist, torch.device("cpu"), download=False)
    b = mnist.load_mnist(tmp_path, torch.device("cpu"), download=False)
    assert a.identity == b.identity and torch.equal(a.train.images, b.train.images)


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_damaged_file_is_data_unavailable_naming_it(tiny_mnist: Path, tmp_path: Path, damage: str) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_mnist, copy)
    victim = copy / "MNIST" / "raw" / "train-labels-idx1-ubyte"
    data = victim.read_bytes()
    victim.write_bytes(data[:-5] if damage == "truncate" else b"GARBAGE!" + data[8:])
    with pytest.raises(mnist.DataUnavailable) as err:
        mnist.load_mnist(copy, torch.device("cpu"), download=False)
    assert str(victim) in str(err.value)


def test_training_start_does_not_import_torchvision(tiny_mnist: Path) -> None:
    """torchvision costs ~2 s of import, paid at every restart; reading the IDX files needs none of it."""
    import subprocess
    import sys

    code = ("import sys, torch; from resumable.cli import train_command; from resumable.tasks import mnist; "
            f"mnist.load_mnist({str(tiny_mnist)!r}, torch.device('cpu'), download=False); "
            "print('torchvision' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_model_shape_and_log_probs() -> None:
    model = mnist.Net()
    out = model(torch.zeros(3, 1, 28, 28))
    assert out.shape == (3, 10)
    assert torch.allclose(out.exp().sum(1), torch.ones(3), atol=1e-5)
    assert sum(p.numel() for p in model.parameters()) == 1_199_882


def test_ddp_ranks_fetch_with_different_augmentation_seeds_and_rank_0_keeps_the_single_process_ones() -> None:
    from resumable.engine.data.sampler import ResumableSampler, epoch_seed
    from resumable.engine.data.sources import EpochBatchSampler, batch_seed

    def seeds(rank: int, world: int) -> list[int]:
        sampler = ResumableSampler(1000, 10, seed=7, rank=rank, world_size=world)
        return [batch.seed for batch in EpochBatchSampler(sampler, epoch=2, start=0)]

    rank0, rank1 = seeds(0, 2), seeds(1, 2)
    assert all(a != b for a, b in zip(rank0, rank1, strict=True)), "every rank would draw the same augmentations"
    assert len(set(rank0) | set(rank1)) == len(rank0) + len(rank1)
    # Rank 0 (and a single process) keep the seeds of before, so no single-process run changes.
    assert rank0 == [epoch_seed(epoch_seed(7, 2), k) for k in range(len(rank0))]
    assert seeds(0, 1)[:3] == rank0[:3] == [batch_seed(7, 2, k) for k in range(3)]


class _Augmented(torch.utils.data.Dataset):
    """Each item is a random draw: a stand-in for a random augmentation."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(2)


def test_fetching_in_the_training_process_leaves_cuda_seeding_and_the_cpu_stream_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.manual_seed reseeds every CUDA generator for good, and with CUDA not yet initialised it queues a
    # manual_seed_all that lands when CUDA starts: a batch fetch would then decide the GPU's dropout masks.
    from resumable.engine.data.sampler import ResumableSampler
    from resumable.engine.data.sources import LoaderBatches

    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(seed))
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    queued_before = (list(torch.cuda._queued_calls), tracker.get_calls() if tracker is not None else None)
    sampler = ResumableSampler(12, 4, seed=3)

    def fetch_epoch() -> list[torch.Tensor]:
        source = LoaderBatches(_Augmented(), num_workers=0)
        fetch = source.epoch(sampler, 0, 0)
        return [fetch(None) for _ in range(sampler.batches_per_epoch)]

    torch.manual_seed(11)
    calls.clear()
    before = torch.get_rng_state()
    first = fetch_epoch()
    assert torch.equal(torch.get_rng_state(), before), "the global CPU stream came back untouched"
    assert calls == [], "fetching seeded the CUDA generators"
    tracker_after = tracker.get_calls() if tracker is not None else None
    assert (list(torch.cuda._queued_calls), tracker_after) == queued_before, "a CUDA seed call was queued"
    torch.rand(5)  # the training stream moves on; the augmentations of a batch do not depend on it
    again = fetch_epoch()
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], first[1])
