"""`resumable chaos --fault KIND`: each fault kind on mini-MNIST, injected into resumable-train with small budgets,
and the run still ends identical to an uninterrupted one; the report names each fault, how it was dealt with and
what it cost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run

TRAIN = ["--max-steps", "200", "--batch-size", "64", "--checkpoint-steps", "10", "--log-every", "1", "--no-download"]


def _chaos(mnist_dir: Path, tmp_path: Path, fault: str, kills: int, *extra: str) -> dict:
    result = run(["chaos", "--fault", fault, "--kills", str(kills), "--seed", "5", "--every", "0.5s", "--warm",
                  "--workdir", str(tmp_path), "--json", "--", "--data-dir", str(mnist_dir), *TRAIN, *extra],
                 name="resumable", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "IDENTICAL" and report["difference"] is None, report
    assert report["unloadable_checkpoints"] == 0
    return report


@pytest.mark.parametrize(("fault", "kills", "ends", "detected"), [
    ("stop-cont", 3, False, "SIGCONT continues"),
    ("segfault", 2, True, "SIGSEGV"),
    ("writer-error", 1, False, "fails with EIO"),
    ("hang", 1, True, "step watchdog"),
])
def test_each_fault_kind_ends_identical(mnist_dir: Path, tmp_path: Path, fault: str, kills: int, ends: bool,
                                        detected: str) -> None:
    report = _chaos(mnist_dir, tmp_path, fault, kills)
    assert len(report["kills"]) == kills and all(k["fault"] == fault for k in report["kills"]), report["kills"]
    for k in report["kills"]:
        assert k["ended_session"] is ends and detected in k["detected"]
        if fault == "stop-cont":
            assert 0.5 <= k["paused_s"] <= 2.0 and k["cost"].startswith("paused")
        if fault == "hang":
            assert k["signal"] == "HANG"  # the session exited 76 (any other exit code fails chaos)
        if ends:  # the next session resumed from a committed checkpoint
            assert k["resumed_from"] is not None and "step(s)" in k["cost"]


def test_mixed_faults_end_identical(mnist_dir: Path, tmp_path: Path) -> None:
    report = _chaos(mnist_dir, tmp_path, "mix", 6, "--max-steps", "400")
    faults = [k["fault"] for k in report["kills"]]
    assert len(faults) == 6 and faults[0] == "kill" and report["kills"][0]["mid_save"], faults  # inside a save
    assert sum(k["first_step"] for k in report["kills"]) == 1  # and once on the first step after a resume
    assert len(set(faults)) >= 3, faults
