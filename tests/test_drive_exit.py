"""Exit 74 (EXIT_NOT_DURABLE, issue #15 item 8): a Drive run whose newest committed checkpoint did not reach Drive by
the end of the session (uploads failed, or still pending at --drive-flush-timeout) does not exit 0 or 75. Judged by
what is durable at exit: a failed pass made good later still ends 0. Against the loopback Drive (tests/fakedrive/)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from fakedrive import FakeDrive
from test_drive import _train_args, drive_env, store

from resumable.cli import train_command
from resumable.errors import EXIT_NOT_DURABLE
from resumable.storage.tiered import durable_steps


def _env(fake: FakeDrive, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in drive_env(fake).items():
        monkeypatch.setenv(key, value)


def test_pending_at_the_flush_timeout_exits_74(tiny_mnist: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeDrive(bandwidth=500_000) as fake:  # ~14 MB per checkpoint: far more than 1 s of upload
        _env(fake, monkeypatch)
        result = CliRunner().invoke(train_command, _train_args(
            "gdrive://root/runs/slow", tiny_mnist, "--max-steps", "3", "--checkpoint-steps", "3",
            "--drive-flush-timeout", "1s", "--cache-dir", str(tmp_path / "cache")))
        print(result.output[-1200:])
        assert result.exit_code == EXIT_NOT_DURABLE, result.output
        assert "durable on Google Drive gdrive://root/runs/slow: steps none; only local: steps 3" in result.output
        assert "the newest checkpoint, step 3, is not durable" in result.output
        assert f"(exit code {EXIT_NOT_DURABLE})" in result.output
        assert durable_steps(store(fake, path="runs/slow"), tmp_path) == []


def test_a_failed_upload_made_good_later_exits_0(tiny_mnist: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeDrive() as fake:
        _env(fake, monkeypatch)
        store(fake, path="runs/later").list_checkpoints()
        fake.inject("storageQuotaExceeded", count=1, match="POST /upload/", skip=1)  # a payload file of step 2
        result = CliRunner().invoke(train_command, _train_args(
            "gdrive://root/runs/later", tiny_mnist, "--max-steps", "4", "--checkpoint-steps", "2", "--keep", "3",
            "--cache-dir", str(tmp_path / "cache")))
        print(result.output[-1200:])
        assert fake.faults_fired, "the upload did fail once"
        assert "storageQuotaExceeded" in result.output
        assert result.exit_code == 0, result.output
        assert "durable on Google Drive gdrive://root/runs/later: steps 2, 4; only local: steps none" in result.output
        assert durable_steps(store(fake, path="runs/later"), tmp_path) == [2, 4]
