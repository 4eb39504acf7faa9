"""Validation at the edge: a bad option value or a damaged MNIST file is exit 2 with a message naming the option
or the file, before anything is created (today some are accepted and train, others are tracebacks)."""

from __future__ import annotations

import gzip
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import make_tiny_mnist, write_idx

from resumable.cli import train_command
from resumable.config import RunOptions, TrainConfig, parse_duration
from resumable.tasks import mnist

QUICK = ["--batch-size", "16", "--max-steps", "1", "--no-progress", "--no-download"]


def invoke(*args: str):
    # catch_exceptions: a traceback is a result (exit 1) that the test reports, not a crash of the test
    return CliRunner().invoke(train_command, list(args))


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("args, option", [
    (["--checkpoint-every", "nan"], "--checkpoint-every"),
    (["--checkpoint-every", "inf"], "--checkpoint-every"),
    (["--mtbf", "nan"], "--mtbf"),
    (["--mtbf", "inf"], "--mtbf"),
    (["--time-limit", "nan"], "--time-limit"),
    (["--time-limit", "inf"], "--time-limit"),
    (["--time-limit", "1e400"], "--time-limit"),  # float() overflows to inf
    (["--drive-flush-timeout", "nan"], "--drive-flush-timeout"),
    (["--drive-flush-timeout", "inf"], "--drive-flush-timeout"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--seed", str(2**64)], "--seed"),
    (["--seed", str(2**63)], "--seed"),
    (["--cache-dir", ""], "--cache-dir"),
])
def test_a_bad_option_value_is_exit_2_naming_it_and_creates_nothing(tiny_mnist: Path, tmp_path: Path,
                                                                    args: list[str], option: str) -> None:
    run_dir = tmp_path / "run"
    result = invoke("--run-dir", str(run_dir), "--data-dir", str(tiny_mnist), *QUICK, *args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert option in result.output, result.output
    assert not run_dir.exists()


@pytest.mark.parametrize("args, option", [
    (["--run-dir", ""], "--run-dir"),
    (["--run-dir", "   "], "--run-dir"),
    (["--data-dir", ""], "--data-dir"),
    (["--run-dir", "runs/" + "n" * 300], "--run-dir"),  # one name longer than NAME_MAX
    (["--run-dir", "/".join(["d" * 200] * 25)], "--run-dir"),  # 5000 bytes: longer than PATH_MAX
    (["--data-dir", "data/" + "n" * 300], "--data-dir"),
], ids=["run-dir-empty", "run-dir-blank", "data-dir-empty", "run-dir-name-too-long", "run-dir-path-too-long",
        "data-dir-name-too-long"])
def test_an_unusable_folder_is_exit_2_naming_it_and_the_current_folder_is_untouched(
        tiny_mnist: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], option: str) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    defaults = {"--run-dir": str(tmp_path / "run"), "--data-dir": str(tiny_mnist)}
    defaults.pop(args[0])
    result = invoke(*[x for kv in defaults.items() for x in kv], *QUICK, *args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert option in result.output, result.output
    assert _listing(cwd) == [], "nothing is trained or downloaded into the current folder"
    assert not (tmp_path / "run").exists()


def _labels(raw: Path, name: str) -> np.ndarray:
    return np.frombuffer((raw / name).read_bytes()[8:], dtype=np.uint8).copy()


def _images(raw: Path, name: str) -> np.ndarray:
    return np.frombuffer((raw / name).read_bytes()[16:], dtype=np.uint8).reshape(-1, 28, 28).copy()


def _label_out_of_range(raw: Path, name: str = "train-labels-idx1-ubyte", value: int = 12) -> None:
    labels = _labels(raw, name)
    labels[5] = value
    write_idx(raw / name, labels)


def _big_images(raw: Path) -> None:
    write_idx(raw / "train-images-idx3-ubyte", np.zeros((96, 32, 32), dtype=np.uint8))


def _fewer_labels(raw: Path) -> None:
    write_idx(raw / "train-labels-idx1-ubyte", _labels(raw, "train-labels-idx1-ubyte")[:-1])


def _labels_2d(raw: Path) -> None:
    write_idx(raw / "train-labels-idx1-ubyte", _labels(raw, "train-labels-idx1-ubyte").reshape(-1, 1))


def _flat_images(raw: Path) -> None:
    write_idx(raw / "t10k-images-idx3-ubyte", _images(raw, "t10k-images-idx3-ubyte").reshape(-1))


def _signed_bytes(raw: Path) -> None:
    path = raw / "t10k-images-idx3-ubyte"
    data = bytearray(path.read_bytes())
    data[2] = 0x09  # IDX type "signed byte"
    path.write_bytes(bytes(data))


def _no_test_images(raw: Path) -> None:
    write_idx(raw / "t10k-images-idx3-ubyte", np.zeros((0, 28, 28), dtype=np.uint8))
    write_idx(raw / "t10k-labels-idx1-ubyte", np.zeros((0,), dtype=np.uint8))


def _trailing_bytes(raw: Path) -> None:
    path = raw / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes() + b"0123456789")


def _gz_label_out_of_range(raw: Path) -> None:
    _label_out_of_range(raw, "t10k-labels-idx1-ubyte", 255)
    path = raw / "t10k-labels-idx1-ubyte"
    path.with_name(path.name + ".gz").write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()


@pytest.mark.parametrize("damage, fragments", [
    (_label_out_of_range, ["train-labels-idx1-ubyte", "label 12", "0..9"]),
    (lambda raw: _label_out_of_range(raw, "t10k-labels-idx1-ubyte", 10), ["t10k-labels-idx1-ubyte", "label 10"]),
    (_big_images, ["train-images-idx3-ubyte", "32x32", "28x28"]),
    (_fewer_labels, ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "95 labels"]),
    (_labels_2d, ["train-labels-idx1-ubyte", "dimensions"]),
    (_flat_images, ["t10k-images-idx3-ubyte", "dimensions"]),
    (_signed_bytes, ["t10k-images-idx3-ubyte", "unsigned bytes"]),
    (_no_test_images, ["t10k-images-idx3-ubyte", "no images"]),
    (_trailing_bytes, ["train-images-idx3-ubyte", "damaged"]),
    (_gz_label_out_of_range, ["t10k-labels-idx1-ubyte.gz", "label 255"]),
], ids=["train-label-12", "test-label-10", "images-32x32", "fewer-labels", "labels-2d", "images-flat",
        "signed-bytes", "no-test-images", "trailing-bytes", "gz-label-255"])
def test_a_damaged_mnist_file_is_exit_2_naming_it_before_training(tmp_path: Path, damage,
                                                                  fragments: list[str]) -> None:
    data = make_tiny_mnist(tmp_path / "data")
    damage(data / "MNIST" / "raw")
    run_dir = tmp_path / "run"
    result = invoke("--run-dir", str(run_dir), "--data-dir", str(data), *QUICK)
    assert result.exit_code == 2, (result.output, result.exception)
    for fragment in fragments:
        assert fragment in result.output, result.output
    assert "Traceback" not in result.output
    assert not run_dir.exists(), "a start refused for its data leaves no run dir behind"


def test_the_loader_names_the_damaged_file(tmp_path: Path) -> None:
    data = make_tiny_mnist(tmp_path)
    raw = data / "MNIST" / "raw"
    _label_out_of_range(raw)
    with pytest.raises(mnist.DataUnavailable, match="label 12 at position 5") as err:
        mnist.load_mnist(data, torch.device("cpu"), download=False)
    assert str(raw / "train-labels-idx1-ubyte") in str(err.value)


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "9" * 400 + "s", "1.2.3s",
                                  ".s", "\u00b2s", "400d"])
def test_parse_duration_refuses_what_is_not_a_finite_duration(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_parse_duration_still_reads_durations() -> None:
    assert parse_duration("1h30m") == 5400.0 and parse_duration("90") == 90.0 and parse_duration("1.5m") == 90.0


@pytest.mark.parametrize("field, value", [
    ("checkpoint_every", "nan"), ("mtbf", "inf"), ("time_limit", "nan"), ("drive_flush_timeout", "inf"),
    ("time_limit", "1e400"), ("cache_dir", ""),
])
def test_the_python_api_refuses_the_same_values(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=field):
        RunOptions(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("lr", math.inf), ("lr", math.nan), ("seed", 2**64), ("seed", 2**63), ("seed", -1), ("seed", True),
    ("run_dir", ""), ("data_dir", ""), ("run_dir", "x" * 300),
])
def test_train_config_refuses_out_of_range_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


def test_the_edges_of_the_ranges_are_accepted(tmp_path: Path) -> None:
    assert TrainConfig(seed=2**63 - 1, lr=1e-9).seed == 2**63 - 1
    assert TrainConfig(run_dir=str(tmp_path / ("n" * os.pathconf(tmp_path, "PC_NAME_MAX")))).run_dir
    assert TrainConfig(run_dir="gdrive://root/runs/x").run_dir.startswith("gdrive://")
