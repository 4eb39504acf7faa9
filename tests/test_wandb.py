"""Weights & Biases across sessions, offline (never the network): one W&B run id for the whole run, and the
records W&B got — read back from its offline ``.wandb`` files — equal ``metrics.jsonl``'s, each step once.

Kill points are random but reproducible: the seed is printed, and RESUMABLE_KILL_SEED replays it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import command, env, policies, run

from resumable.checkpoint import CheckpointManager, checkpoints_dir
from resumable.checkpoint import format as fmt
from resumable.checkpoint.layout import STEPS
from resumable.reporting.metrics import TIMING_FIELDS, read_records

wandb = pytest.importorskip("wandb")

from resumable.reporting.wandb_files import history  # noqa: E402 - after the importorskip

MAX_STEPS = 30  # tiny_mnist: 96 images, batch 16 -> 6 steps an epoch, an evaluation at every 6th step
ARGS = ["--max-steps", str(MAX_STEPS), "--batch-size", "16", "--checkpoint-steps", "4", "--log-every", "1",
        "--no-progress", "--no-download", "--wandb", "resumable-test"]


def _wandb_env(tmp_path: Path, mode: str = "offline") -> dict[str, str]:
    return {"WANDB_MODE": mode, "WANDB_DIR": str(tmp_path / "wb"), "WANDB_SILENT": "true",
            "WANDB_DISABLE_GIT": "true", "WANDB_CONSOLE": "off"}


def _offline_files(tmp_path: Path) -> list[Path]:
    """One ``.wandb`` file per session, in session order (the folder names start with the time)."""
    return sorted((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))


def _rows(files: list[Path]) -> list[dict]:
    wandb.teardown()  # in this process: finish() can return before wandb-core has closed the file
    return [row for path in files for row in history(path)]


def _manifest_ids(run_dir: Path) -> set:
    return {json.loads((p / fmt.MANIFEST).read_text()).get("wandb_run_id")
            for _, p in CheckpointManager(checkpoints_dir(run_dir)).step_dirs() if (p / fmt.MANIFEST).exists()}


def _by_step(records: list[dict]) -> dict[int, dict]:
    """metrics.jsonl's records merged per step (a step's train and eval records are one W&B row), no timing."""
    merged: dict[int, dict] = {}
    for record in records:
        merged.setdefault(record["step"], {}).update(
            {k: v for k, v in record.items() if k != "step" and k not in TIMING_FIELDS})
    return merged


def _assert_wandb_equals_metrics(run_dir: Path, rows: list[dict]) -> None:
    steps = [row["_step"] for row in rows]
    assert steps == sorted(set(steps)), f"W&B steps are not strictly increasing (a duplicate or a rewind): {steps}"
    got = {row["_step"]: {k: v for k, v in row.items() if not k.startswith("_") and k not in TIMING_FIELDS}
           for row in rows}
    expected = _by_step(read_records(run_dir / "metrics.jsonl"))
    assert sorted(got) == sorted(expected), "W&B has other steps than metrics.jsonl"
    assert got == expected, "W&B's values differ from metrics.jsonl's"


def _max_logged_step(run_dir: Path) -> int:
    return max((r["step"] for r in read_records(run_dir / "metrics.jsonl")), default=0)


def _has_checkpoint(run_dir: Path) -> bool:
    return CheckpointManager(checkpoints_dir(run_dir)).latest_valid()[0] is not None


def _wait_for(proc: subprocess.Popen, condition, timeout: float = 180) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if condition():
            return True
        time.sleep(0.005)
    raise AssertionError("timed out waiting for the training process")


# buffered: wandb's default, a killed session's records never reach its file (all come from metrics.jsonl);
# flushed: its file is written every 0.1 s, so it holds rows past the resumed checkpoint (skipped, not resent).
# flushed runs in the soak set: test_steps_w_and_b_already_has_are_not_sent_again covers the skipped rows.
@pytest.mark.parametrize("flush", ["buffered", pytest.param("flushed", marks=pytest.mark.soak)])
def test_two_sigkills_one_wandb_run_with_the_records_of_metrics_jsonl(tiny_mnist: Path, tmp_path: Path,
                                                                      flush: str) -> None:
    seed = int(os.environ.get("RESUMABLE_KILL_SEED", random.SystemRandom().randrange(2**31)))
    print(f"kill seed {seed} (replay with RESUMABLE_KILL_SEED={seed})")
    rng = random.Random(seed)
    run_dir, extra = tmp_path / "run", _wandb_env(tmp_path)
    if flush == "flushed":
        extra["WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL"] = "0.1"
    target, kills = 0, []
    for _ in range(2):
        # past the first checkpoint (step 4), and past the step the last kill reached, so that this session has
        # trained (and opened its W&B run) before it is killed; a kill that overshoots its target by a few steps
        # would otherwise let the next session be killed before it logged anything.
        target = max(target + rng.randint(2, 8), 5, kills[-1] + 1 if kills else 0)
        proc = subprocess.Popen(command() + ["--run-dir", str(run_dir), "--data-dir", str(tiny_mnist), *ARGS],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env(**extra),
                                stdin=subprocess.DEVNULL)
        reached = _wait_for(proc, lambda t=target: _has_checkpoint(run_dir) and _max_logged_step(run_dir) >= t)
        if reached:
            time.sleep(rng.uniform(0, 0.2))
            proc.send_signal(signal.SIGKILL)
        _, stderr = proc.communicate()
        assert reached, f"the session ended before step {target}: {stderr}"
        kills.append(_max_logged_step(run_dir))
    final = run(["--run-dir", str(run_dir), "--data-dir", str(tiny_mnist), *ARGS], **extra)
    assert final.returncode == 0, final.stderr
    assert "trains them to other values" not in final.stderr, "exact resumes train W&B's steps to its values"
    print(f"killed after steps {kills}; final session: {final.stderr[-600:]}")

    files = _offline_files(tmp_path)
    assert len(files) == 3, f"one offline W&B run folder per session: {files}"
    ids = {path.name for path in files} | {f"run-{i}.wandb" for i in _manifest_ids(run_dir)}
    assert len(ids) == 1, f"one W&B run id in every session and every checkpoint: {ids}"
    per_session = [[row["_step"] for row in history(path)] for path in files]
    print(f"steps W&B got per session: {per_session}")
    assert per_session[-1], "the final session logged to W&B"
    rows = _rows(files)
    assert [r["_step"] for r in rows][-1] == MAX_STEPS
    _assert_wandb_equals_metrics(run_dir, rows)


def test_steps_w_and_b_already_has_are_not_sent_again(tiny_mnist: Path, tmp_path: Path) -> None:
    """A session that ended cleanly gave W&B steps up to 10; the run then resumes from step 8 (the newer
    checkpoints deleted, as when they were never committed): steps 9 and 10 are skipped, and said so once."""
    run_dir, extra = tmp_path / "run", _wandb_env(tmp_path)
    base = ["--run-dir", str(run_dir), "--data-dir", str(tiny_mnist), *ARGS]
    first = run([*base, "--max-steps", "10"], **extra)
    assert first.returncode == 0, first.stderr
    manager = CheckpointManager(checkpoints_dir(run_dir))
    for step in (9, 10):  # 10: the last step; 9 does not exist (checkpoints at 4, 6, 8, 10)
        if (run_dir / "checkpoints" / STEPS.name(step)).exists():
            manager.delete(run_dir / "checkpoints" / STEPS.name(step))
    assert manager.latest_valid()[0].step == 8
    second = run([*base, "--max-steps", "16"], **extra)
    assert second.returncode == 0, second.stderr
    message = "W&B already has steps up to 10; records up to 10 are not sent again"
    assert second.stderr.count(message) == 1, second.stderr
    assert "trains them to other values" not in second.stderr, "an exact resume trains 9 and 10 to W&B's values"
    files = _offline_files(tmp_path)
    assert [[r["_step"] for r in history(p)] for p in files] == [list(range(1, 11)), list(range(11, 17))]
    _assert_wandb_equals_metrics(run_dir, _rows(files))


def test_wandb_disabled_trains_and_keeps_the_run_id(tiny_mnist: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run(["--run-dir", str(run_dir), "--data-dir", str(tiny_mnist), *ARGS, "--max-steps", "6"],
                 **_wandb_env(tmp_path, mode="disabled"))
    assert result.returncode == 0, result.stderr
    assert _max_logged_step(run_dir) == 6
    ids = _manifest_ids(run_dir)
    assert len(ids) == 1 and None not in ids, ids
    assert not _offline_files(tmp_path), "disabled: W&B writes nothing"


def test_wandb_not_installed_exits_2_with_the_fix(tiny_mnist: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    no_wandb = "import sys; sys.modules['wandb'] = None; import resumable.cli as m; m.train_command()"
    result = subprocess.run([sys.executable, "-c", no_wandb, "--run-dir", str(run_dir), "--data-dir",
                             str(tiny_mnist), *ARGS], capture_output=True, text=True, timeout=300,
                            env=env(**_wandb_env(tmp_path)), stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    assert "pip install 'resumable[wandb]'" in result.stderr
    assert not _has_checkpoint(run_dir), "nothing trained"


def _api_run(run_dir: Path, loss_scale: float = 1.0, **options):
    from resumable import Run

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    run = Run(run_dir, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data,
              batch_size=8, **policies(progress=False, log_every=1, checkpoint_steps=2, **options))
    for _epoch, _step, (x, y) in run:
        loss = torch.nn.functional.cross_entropy(model(x), y) * loss_scale
        run.optimizer.zero_grad()
        loss.backward()
        run.optimizer.step()
        run.log(loss)
    return run


def test_api_tracker_wandb_continues_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {**_wandb_env(tmp_path), "WANDB_PROJECT": "resumable-test"}.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    assert _api_run(run_dir, tracker="wandb", epochs=1).finished
    assert _api_run(run_dir, wandb="resumable-test", epochs=2).finished  # the project alone turns it on too
    wandb.teardown()  # in this process: finish() can return before wandb-core has closed the file
    files = _offline_files(tmp_path)
    assert len(files) == 2 and len({p.name for p in files} | {f"run-{i}.wandb" for i in _manifest_ids(run_dir)}) == 1
    assert [[r["_step"] for r in history(p)] for p in files] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    _assert_wandb_equals_metrics(run_dir, _rows(files))


def test_steps_w_and_b_has_are_skipped_only_when_trained_again_to_the_same_values(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """W&B has steps 1-10; the run resumes from step 6 (checkpoints 8 and 10 gone, as after a fallback) and trains
    7-10 again. An exact resume reproduces W&B's values: nothing is said. A resume that does not (here the loop's
    code changed: the loss is doubled) is said once, naming the steps W&B keeps from the earlier session."""
    for key, value in {**_wandb_env(tmp_path), "WANDB_PROJECT": "resumable-test"}.items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    manager = CheckpointManager(checkpoints_dir(run_dir))

    def back_to_6() -> None:
        wandb.teardown()  # wandb-core closes the session's file: the next session reads it whole
        for step, path in manager.step_dirs():
            if step > 6:
                manager.delete(path)

    differs = "already has steps 7 to 10, and this session trains them to other values (step 7: loss "
    assert _api_run(run_dir, tracker="wandb", epochs=2).finished  # 5 steps an epoch
    back_to_6()
    assert _api_run(run_dir, tracker="wandb", epochs=2).finished
    assert "other values" not in caplog.text, "the exact resume trained 7-10 to W&B's values"
    back_to_6()
    caplog.clear()
    assert _api_run(run_dir, tracker="wandb", epochs=3, loss_scale=2.0).finished
    assert caplog.text.count(differs) == 1, caplog.text
    assert "W&B cannot take a step twice, so it keeps the earlier values of steps 7 to 10" in caplog.text
    wandb.teardown()
    files = _offline_files(tmp_path)
    assert [[r["_step"] for r in history(p)] for p in files] == [list(range(1, 11)), [], list(range(11, 16))]
    rows = _rows(files)
    assert [r["_step"] for r in rows] == list(range(1, 16)), "steps are never sent twice"
    after = {step: values for step, values in _by_step(read_records(run_dir / "metrics.jsonl")).items() if step > 10}
    assert {r["_step"]: {k: v for k, v in r.items() if not k.startswith("_") and k not in TIMING_FIELDS}
            for r in rows if r["_step"] > 10} == after, "the steps after W&B's last one are sent as usual"


def test_online_the_steps_w_and_b_has_are_read_back_with_its_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Online, W&B's rows come from its public API (no network here: a stand-in); unreadable, that is said."""

    class Online:  # a resumed online W&B run whose server has steps 1-3 from another history
        id, starting_step, path = "online12", 4, "me/resumable-test/online12"
        settings = type("Settings", (), {"mode": "online"})()

        def __init__(self) -> None:
            self.logged: list[int] = []

        def log(self, row, step):  # noqa: ANN001
            self.logged.append(step)

    scans = []

    class Api:
        def run(self, path):  # noqa: ANN001
            history = [{"_step": s, "_runtime": 1.0, "epoch": 1, "loss": 9.0} for s in (1, 2, 3)]
            return type("Run", (), {"scan_history": lambda _, **kw: scans.append((path, kw)) or history})()

    monkeypatch.setattr(wandb, "Api", Api)
    run = Online()
    _api_run(tmp_path / "run", tracker=run, epochs=1)
    assert scans == [("me/resumable-test/online12", {"min_step": 1, "max_step": 4, "use_cache": False})]
    assert sorted(set(run.logged)) == [4, 5], "steps 1-3 are W&B's already"
    assert "already has steps 1 to 3, and this session trains them to other values (step 1: loss " in caplog.text

    def offline_api():  # noqa: ANN202
        raise wandb.errors.CommError("no network")

    monkeypatch.setattr(wandb, "Api", offline_api)
    caplog.clear()
    run = Online()
    _api_run(tmp_path / "run2", tracker=run, epochs=1)
    assert sorted(set(run.logged)) == [4, 5]
    assert "could not be read back to compare (CommError: no network)" in caplog.text


def test_api_takes_a_wandb_run_object_and_records_its_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in _wandb_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    (tmp_path / "wb").mkdir()
    mine = wandb.init(project="resumable-test", dir=str(tmp_path / "wb"))
    try:
        _api_run(tmp_path / "run", tracker=mine, epochs=1)
        assert _manifest_ids(tmp_path / "run") == {mine.id}
        mine.log({"after": 1.0}, step=100)  # still the user's to use: resumable did not finish it
    finally:
        mine.finish()
    rows = _rows(_offline_files(tmp_path))
    assert [r["_step"] for r in rows] == [1, 2, 3, 4, 5, 100]
    _assert_wandb_equals_metrics(tmp_path / "run", rows[:-1])


def test_a_failing_wandb_never_stops_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Down:  # a W&B run whose service died: every log raises wandb's own error
        id, starting_step = "down1234", 0
        settings = type("Settings", (), {"mode": "online"})()

        def log(self, row, step):  # noqa: ANN001
            raise wandb.errors.CommError("wandb-core is gone")

    run = _api_run(tmp_path / "run", tracker=Down(), epochs=1)
    assert run.finished and _max_logged_step(tmp_path / "run") == 5
    assert _manifest_ids(tmp_path / "run") == {"down1234"}
    assert "W&B log failed: CommError: wandb-core is gone" in caplog.text
    assert "training and checkpoints go on" in caplog.text
