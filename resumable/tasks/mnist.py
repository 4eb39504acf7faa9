"""The seed task: the CNN of the classic Colab MNIST guide, and MNIST as device-resident tensors."""

from __future__ import annotations

import gzip
import hashlib
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ResumableError

MEAN, STD = 0.1307, 0.3081
RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
IMAGE_SIZE = (28, 28)  # the model's fc1 (9216 inputs) is sized for it
NUM_CLASSES = 10
_CHUNK = 1 << 20


class DataUnavailable(ResumableError):
    """MNIST files are missing and could not be downloaded; the message says where to put them."""


class Dropout(nn.Dropout):
    """``nn.Dropout`` with the same distribution (keep each element with probability 1-p, scale by 1/(1-p)).

    On the CPU the mask is drawn as ``rand >= p``: ``bernoulli_`` there is about 2.5x slower than a
    uniform draw plus a compare, and dropout was ~10% of a training step. On CUDA the fused native kernel
    is used.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0 or x.is_cuda:
            return super().forward(x)
        keep = (torch.rand_like(x) >= self.p).to(x.dtype)
        return x * keep * (1.0 / (1.0 - self.p))


class Net(nn.Module):
    """Conv(1,32,3) → ReLU → Conv(32,64,3) → ReLU → maxpool 2 → Dropout .25 → FC 9216→128 → ReLU →
    Dropout .5 → FC 128→10 → log_softmax, exactly as in the guide."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = Dropout(0.25)
        self.dropout2 = Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def loss_fn(log_probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # The guide feeds log_softmax output to CrossEntropyLoss, which applies log_softmax a second time.
    # NLL on the log-probabilities is the loss the model was designed for.
    return F.nll_loss(log_probs, target)


def build_model(device: torch.device) -> Net:
    """The seed CNN on ``device`` in channels_last layout, which lets oneDNN/cuDNN use their fastest
    convolution and pooling kernels (about 10% faster per step on a 2-core CPU)."""
    return Net().to(device, memory_format=torch.channels_last)


def make_optimizer(model: nn.Module, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """Adam as in the guide. The fused kernel (one pass over all parameters) is used where this torch
    has it for ``device``; it computes the same update with fewer passes over memory."""
    try:
        return torch.optim.Adam(model.parameters(), lr=lr, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.Adam(model.parameters(), lr=lr)


@dataclass
class TensorSplit:
    """A dataset split already normalised and resident on the training device."""

    images: torch.Tensor  # float32 [N, 1, 28, 28]
    labels: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return self.labels.shape[0]


@dataclass
class MnistData:
    train: TensorSplit
    test: TensorSplit
    identity: dict[str, object]  # what a checkpoint must match: name, sizes, content hash


def expected_location(data_dir: str | Path) -> Path:
    return Path(data_dir) / "MNIST" / "raw"


def _missing(data_dir: Path) -> list[str]:
    raw = expected_location(data_dir)
    return [name for name in RAW_FILES if not (raw / name).is_file() and not (raw / f"{name}.gz").is_file()]


def _raw_file(data_dir: Path, name: str) -> Path:
    raw = expected_location(data_dir) / name
    return raw if raw.is_file() else raw.with_name(f"{name}.gz")


def read_idx(path: Path, ndim: int | None = None) -> torch.Tensor:
    """An IDX file of unsigned bytes (plain or .gz) as a uint8 tensor, parsed the way torchvision does;
    ``ndim``, when given, is the number of dimensions the file must have.

    Read directly instead of through ``torchvision.datasets.MNIST``: importing torchvision costs about two
    seconds, paid again at every restart after a disconnect. The header is checked before the data is read,
    and no more data is read than it promises (plus one byte, to see trailing garbage), so a damaged header
    or a .gz that inflates without end cannot take the memory."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as handle:
        magic = handle.read(4)
        if len(magic) < 4 or magic[:2] != b"\0\0" or magic[2] != 0x08:
            raise ValueError(f"{path} is not an IDX file of unsigned bytes (bad header {magic.hex() or 'empty'})")
        if ndim is not None and magic[3] != ndim:
            raise ValueError(f"{path} has {magic[3]} dimensions in its header; this file must have {ndim}")
        raw_dims = handle.read(4 * magic[3])
        if len(raw_dims) != 4 * magic[3]:
            raise ValueError(f"{path} is truncated or damaged: its header ends early")
        dims = struct.unpack(f">{magic[3]}I", raw_dims)
        size = math.prod(dims)
        data = bytearray()
        while len(data) <= size:
            chunk = handle.read(min(_CHUNK, size + 1 - len(data)))
            if not chunk:
                break
            data += chunk
    if len(data) != size:
        found = "more" if len(data) > size else f"{len(data)} bytes"
        raise ValueError(f"{path} is truncated or damaged: the header promises shape {dims} ({size} bytes of "
                         f"data), the file holds {found}")
    return torch.frombuffer(data, dtype=torch.uint8).reshape(dims) if size else torch.zeros(dims, dtype=torch.uint8)


def _check_split(images: torch.Tensor, labels: torch.Tensor, image_file: Path, label_file: Path) -> None:
    """A split the seed model can train on: 28x28 images, one label 0..9 per image, at least one of each.
    Checked at load, so damaged data is an exit 2 naming the file before training, not a traceback in it."""
    fix = "Replace it with a good copy of MNIST (or delete it to download it again)."
    if tuple(images.shape[1:]) != IMAGE_SIZE:
        shape = "x".join(str(d) for d in images.shape[1:])
        raise DataUnavailable(f"{image_file} holds images of {shape} pixels; MNIST images are 28x28. {fix}")
    if images.shape[0] == 0:
        raise DataUnavailable(f"{image_file} holds no images. {fix}")
    if labels.shape[0] != images.shape[0]:
        raise DataUnavailable(f"{image_file} holds {images.shape[0]} images but {label_file} holds "
                              f"{labels.shape[0]} labels; they must pair up one to one. {fix}")
    wrong = (labels >= NUM_CLASSES).nonzero()
    if len(wrong):
        index = int(wrong[0, 0])
        raise DataUnavailable(f"{label_file} has label {int(labels[index])} at position {index} (and "
                              f"{len(wrong)} out of range in all); MNIST labels are 0..9. {fix}")


def _download(data_dir: Path) -> None:
    from torchvision import datasets  # imported lazily: it is slow and only needed to download

    for train in (True, False):
        datasets.MNIST(root=str(data_dir), train=train, download=True)


def load_mnist(data_dir: str | Path, device: torch.device, download: bool = True) -> MnistData:
    """Read MNIST (torchvision layout ``DATA_DIR/MNIST/raw``) once and keep it on ``device``.

    Normalisation matches ``ToTensor()`` + ``Normalize((0.1307,), (0.3081,))`` bit for bit.
    """
    data_dir = Path(data_dir)
    missing = _missing(data_dir)
    if missing and not download:
        raise DataUnavailable(_where_message(data_dir, missing, "downloading is off (--no-download)"))
    if missing:
        try:
            _download(data_dir)
        except (RuntimeError, OSError, ValueError) as e:
            raise DataUnavailable(_where_message(data_dir, _missing(data_dir) or missing,
                                                 f"the download failed: {e}")) from e
    files = [_raw_file(data_dir, name) for name in RAW_FILES]
    try:
        arrays = [read_idx(path, ndim=3 if "images" in path.name else 1) for path in files]
    except (OSError, ValueError, EOFError) as e:  # EOFError: a truncated .gz; BadGzipFile is an OSError
        raise DataUnavailable(f"cannot read MNIST in {expected_location(data_dir)}: {e}. Replace the damaged "
                              f"file with a good copy (or delete it to download it again).") from e
    digest = hashlib.sha256()
    tensors = []
    for first in (0, 2):  # (train images, labels), (test images, labels)
        raw, targets = arrays[first], arrays[first + 1]
        _check_split(raw, targets, files[first], files[first + 1])
        targets = targets.to(torch.int64)
        digest.update(raw.numpy().tobytes())
        digest.update(targets.numpy().tobytes())
        images = ((raw.to(torch.float32) / 255.0) - MEAN) / STD
        images = images.unsqueeze(1).to(device).contiguous(memory_format=torch.channels_last)
        tensors.append(TensorSplit(images, targets.to(device)))
    identity = {"name": "mnist", "train_size": len(tensors[0]), "test_size": len(tensors[1]),
                "sha256": digest.hexdigest()[:16]}
    return MnistData(tensors[0], tensors[1], identity)


def _where_message(data_dir: Path, missing: list[str], why: str) -> str:
    return (f"MNIST files are missing in {expected_location(data_dir)} ({', '.join(missing)}) and {why}. "
            f"Copy the four MNIST files (train-images-idx3-ubyte, train-labels-idx1-ubyte, "
            f"t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, optionally .gz) into that folder, "
            f"or pass --data-dir pointing at a folder that has MNIST/raw/ inside.")


@torch.no_grad()
def evaluate(model: nn.Module, split: TensorSplit, batch_size: int = 128) -> tuple[float, float]:
    """Mean NLL loss and accuracy on ``split``; leaves the model in train mode.

    Small batches keep activations in cache: on a 2-core CPU, batch 128 evaluates 3x faster than 1000."""
    model.eval()
    total_loss = torch.zeros((), dtype=torch.float64, device=split.labels.device)
    correct = torch.zeros((), dtype=torch.int64, device=split.labels.device)
    for start in range(0, len(split), batch_size):
        images = split.images[start:start + batch_size]
        labels = split.labels[start:start + batch_size]
        log_probs = model(images)
        total_loss += F.nll_loss(log_probs, labels, reduction="sum").double()
        correct += (log_probs.argmax(dim=1) == labels).sum()
    model.train()
    return total_loss.item() / len(split), correct.item() / len(split)
