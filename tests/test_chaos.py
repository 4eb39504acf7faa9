"""`resumable chaos` proves interruption recovery, and can fail: a broken engine is reported DIVERGED."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run

TRAIN = ["--max-steps", "120", "--batch-size", "64", "--checkpoint-steps", "10", "--log-every", "1", "--no-download"]


def test_chaos_five_kills_identical(mnist_dir: Path, tmp_path: Path) -> None:
    # Warm restarts (fork server) keep this test short; the broken-engine test below restarts cold.
    # About 2.5 s of training between the 5 kills, far from the run's 200 steps even on a fast machine, so
    # all 5 land before it finishes.
    result = run(["chaos", "--kills", "5", "--signal", "mix", "--seed", "3", "--every", "0.5s", "--warm",
                  "--workdir", str(tmp_path), "--json", "--", "--data-dir", str(mnist_dir), *TRAIN,
                  "--max-steps", "200"],
                 name="resumable", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "IDENTICAL" and report["difference"] is None
    assert len(report["kills"]) == 5 and report["kills"][0]["mid_save"]  # confirmed: a write was in progress
    assert all(k["restart_to_first_step_s"] is not None for k in report["kills"])
    assert report["unloadable_checkpoints"] == 0
    assert report["fingerprint"] == report["reference_fingerprint"]
    assert 0 < report["goodput"] <= 1.5


def test_chaos_detects_a_broken_engine(mnist_dir: Path, tmp_path: Path) -> None:
    # Kills land >= 0.6 s into each session, well after the first checkpoint (every 3 steps) is committed,
    # so every restart goes through the broken restore; even one such restart must be caught.
    result = run(["chaos", "--kills", "2", "--seed", "4", "--every", "2s", "--mid-save-every", "0",
                  "--break-rng-restore", "--workdir", str(tmp_path), "--", "--data-dir", str(mnist_dir), *TRAIN,
                  "--checkpoint-steps", "3",  # a checkpoint (so a broken restore) before any kill can land
                  "--max-steps", "200"],  # the kills (1.3 s, 0.9 s in) land before the end on a fast machine too
                 name="resumable", timeout=600)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "DIVERGED" in result.stdout and "fingerprint" in result.stdout


def test_fork_server_children_are_real_processes(mnist_dir: Path, tmp_path: Path) -> None:
    import os
    import signal
    import time

    from resumable.tools.forkserver import ForkServer

    server = ForkServer()
    try:
        bad = server.spawn(["--epochs", "-1"], dict(os.environ))
        assert bad.wait() == 2 and "--epochs" in bad.stderr.read()
        child = server.spawn(["--data-dir", str(mnist_dir), "--run-dir", str(tmp_path / "run"), "--no-progress",
                              "--epochs", "50"], dict(os.environ))
        assert child.pid != os.getpid() and child.poll() is None
        time.sleep(0.5)
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
        child.stderr.close()
    finally:
        server.close()


def test_chaos_refuses_a_run_dir_option(tmp_path: Path) -> None:
    result = run(["chaos", "--", "--run-dir", str(tmp_path)], name="resumable")
    assert result.returncode == 2 and "leave --run-dir out" in result.stderr


def test_report_says_when_the_run_finished_before_all_kills() -> None:
    from resumable.tools.chaos import ChaosReport, Kill, format_report

    kills = [Kill(1, "KILL", True, 40, 38, 2, 0.2), Kill(2, "TERM", False, 80, 80, 0, 0.2)]
    report = ChaosReport("IDENTICAL", None, kills, 10.0, 9.0, "a", "a", 0, kills_planned=3)
    text = format_report(report)
    assert "the run finished after 2 of the 3 kills asked for" in text
    assert text.splitlines()[-1] == "IDENTICAL" and "goodput 90.0%" in text
    assert "finished after" not in format_report(ChaosReport("IDENTICAL", None, kills, 10.0, 9.0, kills_planned=2))
