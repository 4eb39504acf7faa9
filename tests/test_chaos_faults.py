"""`resumable chaos --fault KIND`: each fault kind on mini-MNIST, injected into resumable-train with small budgets,
and the run still ends identical to an uninterrupted one; the report names each fault, how it was dealt with and
what it cost."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from fakedrive import FakeDrive, make_drive
from helpers import run

from resumable.storage.gdrive import DriveLocation, GDriveStore
from resumable.storage.tiered import durable_steps
from resumable.tools.faultkinds import KINDS, draw, pool

TRAIN = ["--max-steps", "120", "--batch-size", "64", "--checkpoint-steps", "10", "--log-every", "1", "--no-download"]


def _chaos(mnist_dir: Path, tmp_path: Path, fault: str, kills: int, *extra: str, options: tuple[str, ...] = (),
           reference: Path | None = None, **env: str) -> dict:
    if reference is not None:
        options = (*options, "--reference", str(reference))
    result = run(["chaos", "--fault", fault, "--kills", str(kills), "--seed", "5", "--every", "0.5s", "--warm",
                  "--workdir", str(tmp_path), "--json", *options, "--", "--data-dir", str(mnist_dir), *TRAIN, *extra],
                 name="resumable", timeout=600, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "IDENTICAL" and report["difference"] is None, report
    assert report["unloadable_checkpoints"] == 0
    return report


@pytest.fixture(scope="module")
def reference(mnist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run of TRAIN for the fault kinds below to compare with (chaos would run one each)."""
    run_dir = tmp_path_factory.mktemp("chaos-reference")
    done = run(["--run-dir", str(run_dir), "--data-dir", str(mnist_dir), *TRAIN, "--no-progress"])
    assert done.returncode == 0, done.stderr
    return run_dir


# stop-cont, segfault and writer-error run in the soak set (about 12 s each): a segfault ends a session as a kill
# does (test_kill.py), a failing writer is test_faults.py's, and a paused session has nothing to detect; the hang
# stays here (the armed fault through chaos, and the watchdog's exit 76 that chaos must accept).
@pytest.mark.parametrize(("fault", "kills", "ends", "detected"), [
    pytest.param("stop-cont", 1, False, "SIGCONT continues", marks=pytest.mark.soak),
    pytest.param("segfault", 1, True, "SIGSEGV", marks=pytest.mark.soak),
    pytest.param("writer-error", 1, False, "fails with EIO", marks=pytest.mark.soak),
    ("hang", 1, True, "step watchdog"),
])
def test_each_fault_kind_ends_identical(mnist_dir: Path, tmp_path: Path, reference: Path, fault: str, kills: int,
                                        ends: bool, detected: str) -> None:
    report = _chaos(mnist_dir, tmp_path, fault, kills, reference=reference)
    assert len(report["kills"]) == kills and all(k["fault"] == fault for k in report["kills"]), report["kills"]
    for k in report["kills"]:
        assert k["ended_session"] is ends and detected in k["detected"]
        if fault == "stop-cont":
            assert 0.5 <= k["paused_s"] <= 2.0 and k["cost"].startswith("paused")
        if fault == "hang":
            assert k["signal"] == "HANG"  # the session exited 76 (any other exit code fails chaos)
            # chaos gives resumable-train --hang-timeout 5s: the watchdog's wait is part of the cost
            assert 5.0 <= k["detected_s"] < 30.0 and "s hung" in k["cost"], k
        if ends:  # the next session resumed from a committed checkpoint
            assert k["resumed_from"] is not None and "step(s)" in k["cost"]


# In the soak set (about 95 s): the default run has each kind above, and the deal below proves a mix draws them all.
@pytest.mark.soak
def test_mixed_faults_end_identical(mnist_dir: Path, tmp_path: Path) -> None:
    # 10: a mid-save kill, a first-step kill, then the 7 kinds (a mix deals each once before any repeats) and one
    # more, so faults that let the session go on (writer-error, stop-cont) are followed by another.
    report = _chaos(mnist_dir, tmp_path, "mix", 10, "--max-steps", "800", options=("--mid-save-every", "9"))
    faults = [k["fault"] for k in report["kills"]]
    assert len(faults) == 10 and faults[0] == "kill" and report["kills"][0]["mid_save"], faults  # inside a save
    assert sum(k["first_step"] for k in report["kills"]) == 1  # and once on the first step after a resume
    assert set(pool("mix")) <= set(faults), faults  # every kind
    assert faults.index("writer-error") < 9, faults  # and the session went on to the next fault after it


def _deal(seed: int, draws: int) -> list[str]:
    """The kinds a mix draws the way chaos does: a session's first fault is fresh; after one that lets the
    session go on (stop-cont, writer-error), the next is drawn for the same session."""
    rng, deck, drawn, fresh = random.Random(seed), [], [], True
    for _ in range(draws):
        kind = draw("mix", rng, fresh=fresh, deck=deck)
        drawn.append(kind.name)
        fresh = kind.ends_session
    return drawn


def test_a_mix_deals_every_kind_in_each_round_of_draws() -> None:
    # armed kinds (hang, writer-error) can only start a session: dealt last, one could wait behind a stop-cont
    # and be skipped for a round; the 10-fault mix test above relies on 7 draws covering all 7 kinds
    for seed in range(300):
        drawn = _deal(seed, 14)
        assert set(drawn[:7]) == set(drawn[7:]) == set(pool("mix")), (seed, drawn)
    assert all(KINDS[n].armed is (n in ("hang", "writer-error")) for n in pool("mix"))


# In the soak set (about 25 s): the proxy's Drive faults are test_faultproxy.py's, and a kill with every Drive
# behaviour on, resumed on a fresh VM, is test_drive_api_behaviour.py's.
@pytest.mark.soak
def test_drive_faults_end_identical_and_the_newest_checkpoint_is_on_drive(mnist_dir: Path, tmp_path: Path) -> None:
    with FakeDrive() as fake:
        env = {"RESUMABLE_DRIVE_ENDPOINT": fake.base_url, "RESUMABLE_DRIVE_TOKEN": "fake-token",
               "RESUMABLE_DRIVE_TIMEOUT": "2", "RESUMABLE_RETRY_BASE_S": "0.05", "RESUMABLE_DRIVE_CHUNK_MIB": "0.25"}
        report = _chaos(mnist_dir, tmp_path, "drive", 4, "--run-dir", "gdrive://root/chaos/{run_dir}",
                        "--max-steps", "80", "--checkpoint-steps", "5", **env)
        assert sorted(k["signal"] for k in report["kills"]) == ["429", "503", "DROP", "STALL"], report["kills"]
        for k in report["kills"]:  # the session went on; the client retried the failed call until answered
            assert k["fault"] == "drive" and not k["ended_session"] and "retries with backoff" in k["detected"]
            assert k["retries"] >= 1 and k["recovered_s"] is not None, k
        assert report["drive_fingerprint"] == report["fingerprint"] == report["reference_fingerprint"]
        chaos_run = GDriveStore(make_drive(fake), DriveLocation.parse(f"gdrive://root/chaos/{tmp_path.name}/chaos"))
        assert durable_steps(chaos_run, tmp_path)[-1] == 80
        assert not fake.server_errors, fake.server_errors


def test_drive_faults_need_a_drive_run_dir(tmp_path: Path) -> None:
    result = run(["chaos", "--fault", "drive", "--workdir", str(tmp_path), "--", "--max-steps", "5"], name="resumable")
    assert result.returncode == 2 and "--run-dir gdrive://root/chaos-test/{run_dir}" in result.stderr, result.stderr
    assert "drive" not in pool("mix") and "drive" in pool("mix", drive=True)
