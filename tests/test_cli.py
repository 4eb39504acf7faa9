"""resumable-train as a user runs it: bad input, real training, determinism."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import final_fingerprint, records, run

from resumable.cli import train_command


def invoke(*args: str):
    return CliRunner().invoke(train_command, list(args), catch_exceptions=False)


@pytest.mark.parametrize("args, fragment", [
    (["--epochs", "-1"], "--epochs"),
    (["--epochs", "0"], "--epochs"),
    (["--batch-size", "0"], "--batch-size"),
    (["--device", "tpu"], "--device"),
    (["--lr", "0"], "--lr"),
    (["--checkpoint-steps", "0"], "--checkpoint-steps"),
    (["--overwrite"], "--overwrite"),
])
def test_bad_values_exit_2_and_touch_nothing(tmp_path: Path, args: list[str], fragment: str) -> None:
    run_dir = tmp_path / "run"
    result = invoke("--run-dir", str(run_dir), "--data-dir", str(tmp_path / "data"), *args)
    assert result.exit_code == 2
    assert fragment in result.output
    assert not run_dir.exists() and not (tmp_path / "data").exists()


def test_unwritable_run_dir_exit_2(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = invoke("--run-dir", str(blocker / "run"), "--data-dir", str(tmp_path))
    assert result.exit_code == 2
    assert "not a writable directory" in result.output
    assert blocker.read_text() == "not a directory"


def test_missing_data_exit_2_with_location(tmp_path: Path) -> None:
    result = invoke("--run-dir", str(tmp_path / "run"), "--data-dir", str(tmp_path / "nodata"), "--no-download",
                    "--no-progress")
    assert result.exit_code == 2
    assert str(tmp_path / "nodata" / "MNIST" / "raw") in result.output
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_same_seed_gives_identical_weights(tiny_mnist: Path, tmp_path: Path) -> None:
    fingerprints = []
    for name in ("a", "b"):
        result = invoke("--run-dir", str(tmp_path / name), "--data-dir", str(tiny_mnist), "--epochs", "2",
                        "--batch-size", "16", "--no-progress")
        assert result.exit_code == 0, result.output
        fingerprints.append(final_fingerprint(tmp_path / name))
    assert fingerprints[0] == fingerprints[1]
    assert records(tmp_path / "a") == records(tmp_path / "b")
    result = invoke("--run-dir", str(tmp_path / "c"), "--data-dir", str(tiny_mnist), "--epochs", "2",
                    "--batch-size", "16", "--seed", "7", "--no-progress")
    assert result.exit_code == 0
    assert final_fingerprint(tmp_path / "c") != fingerprints[0]


def test_metrics_records(tiny_mnist: Path, tmp_path: Path) -> None:
    result = invoke("--run-dir", str(tmp_path / "r"), "--data-dir", str(tiny_mnist), "--epochs", "2",
                    "--batch-size", "16", "--log-every", "2", "--no-progress")
    assert result.exit_code == 0, result.output
    recs = records(tmp_path / "r")
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "test_acc" in r]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12]
    assert all({"step", "epoch", "loss", "lr"} <= set(r) for r in train)
    assert [(r["epoch"], r["step"]) for r in evals] == [(1, 6), (2, 12)]
    assert all({"test_loss", "test_acc", "train_loss"} <= set(r) for r in evals)


def test_end_to_end_real_mnist_one_epoch(mnist_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "check"
    result = run(["--data-dir", str(mnist_dir), "--epochs", "1", "--run-dir", str(run_dir), "--no-progress"])
    assert result.returncode == 0, result.stderr
    assert "test_acc" in result.stderr
    acc = [r["test_acc"] for r in records(run_dir) if "test_acc" in r]
    assert len(acc) == 1 and acc[0] >= 0.95, acc


def test_every_option_of_every_command_says_what_it_does() -> None:
    """Issue #34, item 5: `--help` explains every option (--epochs, --batch-size, --lr and --seed had no text)."""
    import click

    from resumable.cli import main

    commands = {"resumable-train": train_command}
    for name in main.list_commands(click.Context(main)):
        commands[f"resumable {name}"] = main.get_command(click.Context(main), name)
    silent = {name: [option.opts[0] for option in command.params
                     if isinstance(option, click.Option) and not option.hidden and not (option.help or "").strip()]
              for name, command in commands.items()}
    assert not {name: options for name, options in silent.items() if options}, silent
