"""Shared fixtures: tiny IDX datasets written by the tests, and the real mini-MNIST when provided."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest

MNIST_ENV = "RESUMABLE_TEST_MNIST"


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) in the IDX format torchvision's MNIST reader parses."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.tobytes())


def make_tiny_mnist(root: Path, train: int = 96, test: int = 40, seed: int = 0) -> Path:
    """A learnable toy MNIST: each class is a bright square at its own position, plus noise."""
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, size=count).astype(np.uint8)
        images = rng.integers(0, 60, size=(count, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            row, col = divmod(int(label), 5)
            images[i, 4 + row * 12: 12 + row * 12, 2 + col * 5: 6 + col * 5] = 255
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return root


@pytest.fixture(scope="session")
def tiny_mnist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mnist(tmp_path_factory.mktemp("tiny-mnist"))


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    value = os.environ.get(MNIST_ENV)
    if not value:
        pytest.skip(f"set {MNIST_ENV} to a folder with MNIST/raw/ (e.g. ../shared/data/mnist-mini) to run "
                    "tests on real MNIST")
    path = Path(value)
    if not (path / "MNIST" / "raw").is_dir():
        pytest.skip(f"{MNIST_ENV}={value} has no MNIST/raw/ folder")
    return path
