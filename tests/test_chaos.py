"""`resumable chaos` proves interruption recovery, and can fail: a broken engine is reported DIVERGED."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import run

from resumable.faults import Faults, held_marker

OWN_MODEL = Path(__file__).resolve().parents[1] / "scripts" / "own_model_example.py"
# A few seconds of training on a small CPU: 150 steps of a tiny CNN, a checkpoint every 5.
OWN = ["--run-dir", "{run_dir}", "--epochs", "5", "--max-steps", "150", "--checkpoint-steps", "5", "--log-every", "1"]
TRAIN = ["--max-steps", "120", "--batch-size", "64", "--checkpoint-steps", "10", "--log-every", "1", "--no-download"]


def test_chaos_three_kills_identical(mnist_dir: Path, tmp_path: Path) -> None:
    # resumable-train with bf16 autocast, 3 chained kills with mixed signals: the first inside a checkpoint write,
    # the second on the very first step after that resume. Warm restarts (fork server) keep this test short; the
    # broken-engine test below restarts cold. About 1.5 s of training between the 3 kills, far from the run's 120
    # steps even on a fast machine, so all 3 land before it finishes.
    result = run(["chaos", "--kills", "3", "--signal", "mix", "--seed", "3", "--every", "0.5s", "--warm",
                  "--workdir", str(tmp_path), "--json", "--", "--data-dir", str(mnist_dir), *TRAIN,
                  "--amp", "bf16"],
                 name="resumable", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "IDENTICAL" and report["difference"] is None
    assert len(report["kills"]) == 3 and report["kills"][0]["mid_save"]  # confirmed: a write was in progress
    first = [k for k in report["kills"] if k["first_step"]]  # the 2nd, or the first after a committed checkpoint
    assert len(first) == 1 and first[0]["step_at_kill"] == first[0]["resumed_from"] + 1, report["kills"]
    assert all(k["restart_to_first_step_s"] is not None for k in report["kills"])
    assert report["unloadable_checkpoints"] == 0
    assert report["fingerprint"] == report["reference_fingerprint"]
    # a ratio of two wall-clock times of this busy machine (the reference ran beside the other tests): only its sign
    # is a fact here; its value is the report's to print (a test of the report checks the figure)
    assert report["goodput"] > 0


# Soak set (about 40 s of cold restarts): the default run catches the same broken restore under a function target.
@pytest.mark.soak
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
    assert "the run finished after 2 of the 3 faults asked for" in text
    assert text.splitlines()[-1] == "IDENTICAL" and "goodput 90.0%" in text
    assert "finished after" not in format_report(ChaosReport("IDENTICAL", None, kills, 10.0, 9.0, kills_planned=2))


def _own_model_chaos(tmp_path: Path, *options: str, kills: int = 2) -> subprocess.CompletedProcess:
    return run(["chaos", "--kills", str(kills), "--signal", "mix", "--seed", "11", "--every", "0.4s", "--workdir",
                str(tmp_path), "--json", *options], name="resumable", timeout=300)


# Soak set (about 30 s of cold restarts): the default run chains kills of the same script under a function target
# below, and test_api.py kills an own-model loop with workers.
@pytest.mark.soak
def test_chaos_chains_three_kills_of_an_own_model_script_with_workers_accumulation_and_amp(tmp_path: Path) -> None:
    # Cold restarts of a plain command line: `python scripts/own_model_example.py --run-dir {run_dir} ...`, with
    # augmentation in 2 DataLoader workers, 2 micro-batches per step and bf16 autocast. Kill 1 lands inside a
    # checkpoint write, kill 2 on the very first step after that resume, kill 3 at a random moment.
    result = _own_model_chaos(tmp_path, "--target", "command", "--", sys.executable, str(OWN_MODEL), *OWN,
                              "--num-workers", "2", "--accumulate", "2", "--amp", "bf16", "--epochs", "10",
                              kills=3)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "IDENTICAL" and report["difference"] is None
    # Kill 3 lands unless the machine trains 150 steps in well under a second.
    assert 2 <= len(report["kills"]) <= 3 and report["kills"][0]["mid_save"]
    assert any(k["first_step"] for k in report["kills"]), report["kills"]
    assert report["kills"][0]["resumed_from"] is not None and report["unloadable_checkpoints"] == 0
    assert report["fingerprint"] == report["reference_fingerprint"] is not None
    assert (tmp_path / "chaos" / "checkpoints").is_dir() and (tmp_path / "reference" / "metrics.jsonl").is_file()


def test_chaos_warm_restarts_a_function_target(tmp_path: Path) -> None:
    # FILE.py:FUNCTION: the fork server imports the script once and calls main(argv) in each forked child.
    result = _own_model_chaos(tmp_path, "--target", f"{OWN_MODEL}:main", "--warm", "--", *OWN)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "IDENTICAL", report["difference"]
    assert 1 <= len(report["kills"]) <= 2 and report["kills"][0]["mid_save"]
    assert all(k["restart_to_first_step_s"] is not None for k in report["kills"])


def test_chaos_detects_a_broken_engine_under_a_function_target(tmp_path: Path) -> None:
    # The fault reaches a user's resumable.Run through RESUMABLE_FAULTS, as it reaches resumable-train.
    # A checkpoint every 2 steps and kills >= 0.3 s into a session: a resume goes through the broken restore
    # even on a loaded machine.
    result = run(["chaos", "--kills", "2", "--seed", "4", "--every", "1s", "--mid-save-every", "0",
                  "--break-rng-restore", "--warm", "--target", f"{OWN_MODEL}:main", "--workdir", str(tmp_path),
                  "--", *OWN, "--checkpoint-steps", "2"], name="resumable", timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "DIVERGED" in result.stdout


@pytest.mark.parametrize(("options", "message"), [
    (["--target", "command", "--warm", "--", "python", "train.py", "--run-dir", "{run_dir}"], "--warm forks"),
    (["--target", "mypkg.train:main", "--", "--epochs", "2"], "write {run_dir} in its arguments"),
    (["--target", "command", "--", "python", "train.py"], "write {run_dir} in its arguments"),
    (["--target", "command"], "--target command runs what follows --"),
    (["--target", "no/such/file.py:main", "--", "--run-dir", "{run_dir}"], "there is no file"),
    (["--target", "mypkg.train", "--", "--run-dir", "{run_dir}"], "is not one of resumable-train"),
    (["--target", "mypkg:not-a-name", "--", "--run-dir", "{run_dir}"], "is not a function name"),
])
def test_chaos_refuses_a_target_it_cannot_run(options: list[str], message: str, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from resumable.cli import main

    result = CliRunner().invoke(main, ["chaos", "--workdir", str(tmp_path), *options])
    assert result.exit_code == 2 and message in result.output, result.output


def test_fork_server_calls_a_function_target_with_the_argument_list(tmp_path: Path) -> None:
    from resumable.tools.forkserver import ForkServer

    script = tmp_path / "my_train.py"
    script.write_text("import sys\n\n"
                      "def main(argv):\n"
                      "    print('argv', argv, sys.argv[0], file=sys.stderr)\n"
                      "    return int(argv[0])\n")
    server = ForkServer(f"{script}:main")
    try:
        child = server.spawn(["3", "--run-dir", "x"], dict(os.environ))
        assert child.wait() == 3
        assert f"argv ['3', '--run-dir', 'x'] {script}" in child.stderr.read()
    finally:
        server.close()
    with pytest.raises(RuntimeError, match="cannot load --target no_such_module_here:main"):
        ForkServer("no_such_module_here:main")


def test_a_sigkill_takes_every_process_of_the_session(tmp_path: Path) -> None:
    # torchrun puts its workers in sessions of their own; a VM going away kills them all the same.
    from resumable.tools.chaos import SESSION_ENV, Chaos, _session_pids

    tag = f"test.{os.getpid()}"
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, SESSION_ENV: tag})
    deadline = time.monotonic() + 30
    while len(_session_pids(tag)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(_session_pids(tag)) == 2
    Chaos._kill(proc, tag)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    while _session_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _session_pids(tag) == []


def test_a_held_save_waits_before_its_manifest_until_the_hold_is_released(tmp_path: Path) -> None:
    # Chaos's mid-save kill: no hold file, no wait; with one, the save says it is held and waits until it is gone.
    hold = tmp_path / "hold"
    faults = Faults(save_hold_file=str(hold))
    started = time.monotonic()
    faults.before_commit(4)
    assert time.monotonic() - started < 0.5 and not Path(held_marker(hold)).exists()
    hold.touch()
    saver = threading.Thread(target=faults.before_commit, args=(6,))
    saver.start()
    deadline = time.monotonic() + 10
    while not Path(held_marker(hold)).exists():
        assert time.monotonic() < deadline, "the save never said it was held"
        time.sleep(0.01)
    time.sleep(0.1)
    assert saver.is_alive()  # held: the manifest is not written while the hold file exists
    hold.unlink()
    saver.join(timeout=10)
    assert not saver.is_alive() and not Path(held_marker(hold)).exists()
