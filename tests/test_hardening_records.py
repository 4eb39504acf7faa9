"""Issue #17, validated records: what resumable reads back from a run dir is checked before it is used.

1. Malformed but JSON-valid manifests make their checkpoint invalid with a reason, and the previous valid one is
   used (never a traceback); step folders named with non-ASCII digits are not checkpoints.
2. The manifest guards itself (``manifest_sha256``): a flipped value is "manifest corrupted", the previous valid
   checkpoint is used, and a resumed run still ends bit-identical to an uninterrupted one. Format 1 manifests
   (no self-checksum) are still read, with a note.
3. JSONL readers (metrics.jsonl, sessions.jsonl) skip undecodable or wrong-typed lines with one warning per file
   and the file is repaired by the next write; resume, inspect and plot never crash on them.
4. ``resumable verify`` after a kill in the middle of a save judges the newest *committed* checkpoint and lists
   the unfinished save separately (``inspect`` likewise).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import command, env, final_fingerprint, replace_bytes, run, shards

from resumable.checkpoint import CheckpointManager, checkpoints_dir, fingerprint
from resumable.checkpoint import format as fmt
from resumable.checkpoint.layout import STEPS
from resumable.checkpoint.sharded import META
from resumable.checkpoint.state_format import TorchFile
from resumable.cli import main
from resumable.faults import Faults
from resumable.reporting.history import SessionLog, read_sessions
from resumable.reporting.metrics import MetricsLog, read_records

TOTAL = 18  # tiny_mnist: 96 images / batch 16 = 6 steps an epoch, 3 epochs
UNFINISHED = "unfinished save (no manifest; ignored, removed at the next start)"


def _args(run_dir: Path, data: Path, *extra: str) -> list[str]:
    return ["--run-dir", str(run_dir), "--data-dir", str(data), "--batch-size", "16", "--epochs", "3",
            "--log-every", "1", "--checkpoint-steps", "2", "--no-progress", "--no-download", *extra]


def _train(run_dir: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    result = run(_args(run_dir, data, *extra))
    assert "Traceback" not in result.stderr, result.stderr
    return result


@pytest.fixture(scope="module")
def base_run(tiny_mnist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trained to step 4 by resumable-train, checkpoints at steps 2 and 4; each test works on a copy."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    result = _train(run_dir, tiny_mnist, "--max-steps", "4")
    assert result.returncode == 0, result.stderr
    return run_dir


@pytest.fixture(scope="module")
def reference(tiny_mnist: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = _train(run_dir, tiny_mnist, "--max-steps", str(TOTAL))
    assert result.returncode == 0, result.stderr
    return final_fingerprint(run_dir)


def _copy(base: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(base, target, symlinks=True)
    return target


def _step_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / STEPS.name(step)


def _manifest(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / fmt.MANIFEST).read_text(encoding="utf-8"))


def reseal(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with a correct self-checksum, computed as documented (sha256 of the canonical JSON of the
    body without the field): a manifest written wrong but consistently, so only field validation catches it."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return {**body, "manifest_sha256": hashlib.sha256(canonical.encode("ascii")).hexdigest()}


def _write(step_dir: Path, content: dict[str, Any] | str) -> None:
    text = content if isinstance(content, str) else json.dumps(content, indent=2)
    (step_dir / fmt.MANIFEST).write_text(text, encoding="utf-8")


def _saved_manager(root: Path, state_format: Any = None) -> CheckpointManager:
    """Checkpoints at steps 2 and 4 written by CheckpointManager.save with the fields a real run records
    (``state_format``: TorchFile() for the state.pt layout of formats 1 and 2)."""
    manager = CheckpointManager(root, state_format=state_format)
    for step in (2, 4):
        payload = {"model": {"w": torch.full((4,), float(step))}, "optimizer": {}}
        manager.save(step, payload, {
            "epoch": 0, "batch_in_epoch": step, "num_threads": 2, "reason": "steps", "world_size": 1,
            "fingerprint": fingerprint(payload["model"], payload["optimizer"]), "metrics": {"test_acc": 0.5},
            "config": {"lr": 0.001, "batch_size": 16}, "computation": {"seed": 0, "batch_size": 16},
            "determinism": {"cudnn_benchmark": False}, "run_id": "0123abcd", "device": "cpu"})
    return manager


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def _set(key: str, value: Any) -> Callable[[dict], dict]:
    return lambda m: {**m, key: value}


def _set_file(**entry: Any) -> Callable[[dict], dict]:
    return lambda m: {**m, "files": {**m["files"], META: {**m["files"][META], **entry}}}


def _rename_file(name: str) -> Callable[[dict], dict]:
    return lambda m: {**m, "files": {**{k: v for k, v in m["files"].items() if k != META}, name: m["files"][META]}}


def _very_deep(m: dict) -> str:
    """Nesting far past Python's recursion limit: only expressible as text."""
    return json.dumps(m)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"


# (id, change to the newest manifest, what the reason names). Each manifest is valid JSON and, where it is a
# dict, carries a correct self-checksum: what is wrong is a type, a range, a missing field or the size.
MALFORMED = [
    ("step-string", _set("step", "4"), "'step'"),
    ("step-missing", lambda m: {k: v for k, v in m.items() if k != "step"}, "'step'"),
    ("format-version-bool", _set("format_version", True), "format_version"),
    ("num-threads-zero", _set("num_threads", 0), "'num_threads'"),
    ("num-threads-string", _set("num_threads", "2"), "'num_threads'"),
    ("num-threads-huge", _set("num_threads", 10**6), "'num_threads'"),
    ("epoch-null", _set("epoch", None), "'epoch'"),
    ("epoch-negative", _set("epoch", -1), "'epoch'"),
    ("batch-in-epoch-float", _set("batch_in_epoch", 1.5), "'batch_in_epoch'"),
    ("created-string", _set("created_unix", "yesterday"), "'created_unix'"),
    ("fingerprint-number", _set("fingerprint", 123), "'fingerprint'"),
    ("metrics-string", _set("metrics", {"test_acc": "high"}), "'metrics'"),
    ("config-list", _set("config", [1, 2]), "'config'"),
    ("computation-null", _set("computation", None), "'computation'"),
    ("world-size-zero", _set("world_size", 0), "'world_size'"),
    ("run-id-number", _set("run_id", 7), "'run_id'"),
    ("file-entry-null", lambda m: {**m, "files": {**m["files"], META: None}}, "'files'"),
    ("file-size-string", _set_file(size="1000"), "'files'"),
    ("file-sha-number", _set_file(sha256=12345), "'files'"),
    ("file-absolute-name", _rename_file("/etc/hostname"), "plain name"),
    ("file-traversal-name", _rename_file(f"../step-000000002/{META}"), "plain name"),
    ("deep-nesting", _set("config", _nested(100)), "nested"),
    ("very-deep-nesting", _very_deep, "nested"),
    ("huge-manifest", _set("config", {"x": "y" * (5 << 20)}), "bytes"),
]


def _damage(step_dir: Path, change: Callable[[dict], Any], seal: bool = True) -> None:
    changed = change(_manifest(step_dir))
    _write(step_dir, reseal(changed) if seal and isinstance(changed, dict) else changed)


# -- 1. validated manifests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, expected", [(c, e) for _, c, e in MALFORMED], ids=[i for i, _, _ in MALFORMED])
def test_malformed_manifest_falls_back_with_its_reason(tmp_path: Path, change, expected: str) -> None:
    manager = _saved_manager(tmp_path / "checkpoints")
    _damage(_step_dir(tmp_path, 4), change)
    latest, skipped = manager.latest_valid()  # must not raise
    assert latest is not None and latest.step == 2
    assert [i.step for i in skipped] == [4]
    reason = skipped[0].reason
    assert reason and expected in reason and "\n" not in reason, reason
    assert [i.valid for i in manager.inspect()] == [True, False]  # listing never raises either
    assert skipped[0].manifest is None


# In the soak set (about 17 s): test_malformed_manifest_falls_back_with_its_reason checks each malformed manifest's
# fall-back and reason in-process; this one runs five of them through resumable-train.
@pytest.mark.soak
def test_malformed_manifest_through_resumable_train(tiny_mnist: Path, base_run: Path, tmp_path: Path) -> None:
    cases = ["num-threads-string", "file-entry-null", "world-size-zero", "deep-nesting", "file-absolute-name"]

    def resume(case: str) -> tuple[str, subprocess.CompletedProcess]:
        change, expected = next((c, e) for i, c, e in MALFORMED if i == case)
        run_dir = _copy(base_run, tmp_path / case)
        _damage(_step_dir(run_dir, 4), change)
        return expected, _train(run_dir, tiny_mnist, "--max-steps", "6")

    with ThreadPoolExecutor(len(cases)) as pool:  # the runs are independent: they start at the same time
        results = dict(zip(cases, pool.map(resume, cases), strict=True))
    for case, (expected, result) in results.items():
        assert result.returncode == 0, (case, result.stderr)
        skip = next((line for line in result.stderr.splitlines() if "skipping checkpoint step 4" in line), "")
        assert expected in skip, (case, result.stderr)
        assert "resuming from step 2" in result.stderr, (case, result.stderr)


@pytest.mark.parametrize("name", ["step-١٢٣", "step-²", "step-𝟠"])
def test_non_ascii_step_dirs_are_not_checkpoints(tmp_path: Path, name: str) -> None:
    manager = _saved_manager(tmp_path / "checkpoints")
    assert STEPS.parse(name) is None
    impostor = tmp_path / "checkpoints" / name
    shutil.copytree(_step_dir(tmp_path, 4), impostor)
    _write(impostor, reseal({**_manifest(impostor), "step": 123}))
    assert [s for s, _ in manager.step_dirs()] == [2, 4]
    latest, skipped = manager.latest_valid()
    assert latest is not None and latest.step == 4 and not skipped


# -- 2. the manifest guards itself ------------------------------------------------------------------------------
def _flip_threads(m: dict) -> dict:
    return {**m, "num_threads": 1 if m["num_threads"] != 1 else 2}


FLIPS = [
    ("num-threads", _flip_threads),
    ("config-value", lambda m: {**m, "config": {**m["config"], "lr": 0.1}}),
    ("epoch", lambda m: {**m, "epoch": m["epoch"] + 1}),
    ("batch-in-epoch", lambda m: {**m, "batch_in_epoch": m["batch_in_epoch"] + 1}),
    ("file-size", _set_file(size=12345)),
    ("file-sha256", lambda m: _set_file(sha256=("0" if m["files"][META]["sha256"][0] != "0" else "1")
                                        + m["files"][META]["sha256"][1:])(m)),
    ("fingerprint", lambda m: {**m, "fingerprint": m["fingerprint"][::-1]}),
    ("run-id", _set("run_id", "someone-else")),
    ("test-acc", lambda m: {**m, "metrics": {"test_acc": 0.99}}),
    ("created", lambda m: {**m, "created_unix": m["created_unix"] + 1}),
]


@pytest.mark.parametrize("change", [c for _, c in FLIPS], ids=[i for i, _ in FLIPS])
def test_flipped_manifest_value_is_detected(tmp_path: Path, change) -> None:
    manager = _saved_manager(tmp_path / "checkpoints")
    _damage(_step_dir(tmp_path, 4), change, seal=False)
    latest, skipped = manager.latest_valid()
    assert latest is not None and latest.step == 2
    assert [i.step for i in skipped] == [4] and "manifest corrupted" in skipped[0].reason, skipped[0].reason


def test_seal_survives_reformatting(tmp_path: Path) -> None:
    """The checksum is over content, not bytes: a manifest re-serialised (Drive restore writes it anew) stays."""
    manager = _saved_manager(tmp_path / "checkpoints")
    step_dir = _step_dir(tmp_path, 4)
    _write(step_dir, json.dumps(_manifest(step_dir), sort_keys=False, separators=(", ", ": ")))
    assert manager.latest_valid()[0].step == 4


# The config flip runs in the soak set: test_flipped_manifest_value_is_detected checks every field's flip, and the
# num-threads one goes through resumable-train to the same fallback.
@pytest.mark.parametrize("flip", ["num-threads", pytest.param("config-batch-size", marks=pytest.mark.soak)])
def test_flipped_manifest_resumes_from_previous_and_ends_bit_identical(tiny_mnist: Path, base_run: Path,
                                                                       tmp_path: Path, reference: str,
                                                                       flip: str) -> None:
    run_dir = _copy(base_run, tmp_path)
    step_dir = _step_dir(run_dir, 4)
    manifest = _manifest(step_dir)
    if flip == "num-threads":
        manifest = _flip_threads(manifest)
    else:
        manifest["config"]["batch_size"] = 32
    _write(step_dir, manifest)  # still valid JSON, but no longer what was written
    result = _train(run_dir, tiny_mnist, "--max-steps", str(TOTAL))
    assert result.returncode == 0, result.stderr
    assert "skipping checkpoint step 4" in result.stderr and "manifest corrupted" in result.stderr, result.stderr
    assert "resuming from step 2" in result.stderr
    assert final_fingerprint(run_dir) == reference


def test_format_1_manifest_is_still_read_with_a_note(tmp_path: Path) -> None:
    manager = _saved_manager(tmp_path / "checkpoints", state_format=TorchFile())  # format 1 wrote state.pt
    step_dir = _step_dir(tmp_path, 4)
    old = {k: v for k, v in _manifest(step_dir).items() if k != "manifest_sha256"}
    _write(step_dir, {**old, "format_version": 1})
    latest, skipped = manager.latest_valid()
    assert latest is not None and latest.step == 4 and not skipped
    runner = CliRunner()
    result = runner.invoke(main, ["verify", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert any(line.startswith("step 4: ok") and "format 1" in line for line in result.output.splitlines())
    text = runner.invoke(main, ["inspect", str(tmp_path)]).output
    assert any("format 1" in line and "latest valid" in line for line in text.splitlines()), text
    entry = json.loads(runner.invoke(main, ["inspect", "--json", str(tmp_path)]).output)["checkpoints"][-1]
    assert entry["valid"] and entry["format_version"] == 1 and "format 1" in entry["note"]


# -- 3. JSONL readers never crash ------------------------------------------------------------------------------
BAD_METRICS = [b"\xff\xfe not UTF-8 \xc3\x28\n", b"[1, 2]\n", b'{"step": "3", "loss": 1.0}\n',
               b'{"step": null}\n', b'"a string"\n', b'{"step": true}\n']
BAD_SESSIONS = [b"\xff\xfe\n", b'{"event": "start", "session": "7", "time": 1.0, "step": 0}\n',
                b'{"event": "start", "session": 9, "time": "noon", "step": 0}\n', b'"a string"\n',
                b'{"event": "end", "session": 1, "time": 2.0, "step": "4", "ended": "finished"}\n']


def _insert(path: Path, bad: list[bytes], after: int = 1) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:after] + bad + lines[after:]))


def _warnings(stderr: str, name: str) -> list[str]:
    return [line for line in stderr.splitlines() if "warning" in line and name in line]


def _clean(path: Path) -> list[dict]:
    """Every line of ``path`` decodes and is a JSON object (the file was repaired)."""
    text = path.read_bytes().decode("utf-8")
    records = [json.loads(line) for line in text.splitlines()]
    assert all(isinstance(r, dict) for r in records)
    return records


def test_read_records_skips_bad_lines_with_one_warning(tmp_path: Path, capsys) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n' + b"".join(BAD_METRICS) + b'{"step": 2, "loss": 1.0}\n'
                     + b'{"step": 3, "lo')  # and a torn last line, which is silent
    assert [r["step"] for r in read_records(path)] == [1, 2]
    warned = _warnings(capsys.readouterr().err, "metrics.jsonl")
    assert len(warned) == 1 and "line 2" in warned[0] and f"{len(BAD_METRICS)} unreadable" in warned[0], warned
    assert MetricsLog(path).rollback(1) == 1  # drops step 2; and the bad lines: the file is repaired
    assert [r["step"] for r in _clean(path)] == [1]
    capsys.readouterr()
    read_records(path)
    assert not _warnings(capsys.readouterr().err, "metrics.jsonl")


def test_read_sessions_skips_bad_lines_and_start_repairs(tmp_path: Path, capsys) -> None:
    path = tmp_path / "sessions.jsonl"
    good = [{"event": "start", "session": 1, "time": 1.0, "step": 0, "resumed_from": None, "host": "h", "pid": 1},
            {"event": "end", "session": 1, "time": 2.0, "step": 4, "ended": "finished"}]
    path.write_bytes(json.dumps(good[0]).encode() + b"\n" + b"".join(BAD_SESSIONS)
                     + json.dumps(good[1]).encode() + b"\n" + b'{"event": "sta')
    sessions = read_sessions(tmp_path)
    assert [(s.session, s.end_step, s.ended) for s in sessions] == [(1, 4, "finished")]
    warned = _warnings(capsys.readouterr().err, "sessions.jsonl")
    assert len(warned) == 1 and "line 2" in warned[0] and f"{len(BAD_SESSIONS)} unreadable" in warned[0], warned
    log = SessionLog(tmp_path)
    assert log.start(4, 4) == 2  # the bad "session 9" record does not count
    log.end(6, "finished")
    assert [r["session"] for r in _clean(path)] == [1, 1, 2, 2]
    capsys.readouterr()
    assert [s.session for s in read_sessions(tmp_path)] == [1, 2]
    assert not _warnings(capsys.readouterr().err, "sessions.jsonl")


def test_metrics_file_that_is_a_directory(tmp_path: Path, capsys) -> None:
    (tmp_path / "metrics.jsonl").mkdir()
    assert read_records(tmp_path / "metrics.jsonl") == []
    assert len(_warnings(capsys.readouterr().err, "metrics.jsonl")) == 1
    assert MetricsLog(tmp_path / "metrics.jsonl").rollback(0) == 0 and (tmp_path / "metrics.jsonl").is_dir()
    for args in (["inspect", str(tmp_path)], ["plot", str(tmp_path)]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code in (0, 2) and isinstance(result.exception, (SystemExit, type(None))), result.output


def test_damaged_jsonl_resume_inspect_and_plot(tiny_mnist: Path, base_run: Path, tmp_path: Path) -> None:
    run_dir = _copy(base_run, tmp_path)
    _insert(run_dir / "metrics.jsonl", BAD_METRICS)
    _insert(run_dir / "sessions.jsonl", BAD_SESSIONS)

    inspected = run(["inspect", str(run_dir)], name="resumable")
    assert inspected.returncode == 0 and "Traceback" not in inspected.stderr, inspected.stderr
    assert len(_warnings(inspected.stderr, "sessions.jsonl")) == 1, inspected.stderr
    plotted = run(["plot", str(run_dir), "--out", str(tmp_path / "p.png")], name="resumable")
    assert plotted.returncode == 0 and "Traceback" not in plotted.stderr, plotted.stderr
    assert len(_warnings(plotted.stderr, "metrics.jsonl")) == 1, plotted.stderr
    assert len(_warnings(plotted.stderr, "sessions.jsonl")) == 1, plotted.stderr

    resumed = _train(run_dir, tiny_mnist, "--max-steps", "6")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step 4" in resumed.stderr
    assert len(_warnings(resumed.stderr, "metrics.jsonl")) == 1, resumed.stderr
    assert len(_warnings(resumed.stderr, "sessions.jsonl")) == 1, resumed.stderr
    # Repaired by that session: every line decodes, the steps are complete, the sessions numbered on.
    assert sorted({r["step"] for r in _clean(run_dir / "metrics.jsonl")}) == list(range(1, 7))
    assert [(r["event"], r["session"]) for r in _clean(run_dir / "sessions.jsonl")] == [
        ("start", 1), ("end", 1), ("start", 2), ("end", 2)]
    again = run(["plot", str(run_dir), "--out", str(tmp_path / "q.png")], name="resumable")
    assert again.returncode == 0 and not _warnings(again.stderr, ".jsonl"), again.stderr


# -- 4. verify and inspect after a kill in the middle of a save -------------------------------------------------
def _unfinished_payload(step_dir: Path) -> bool:
    # meta.pt is the last payload file a save writes, after its shards
    return step_dir.is_dir() and (step_dir / META).exists() and not (step_dir / fmt.MANIFEST).exists()


# In the soak set (about 14 s): test_kill_sharded.py's kill inside a multi-shard write and test_kill.py's kill in a
# save check that such a save never counts; verify's judgement of damaged checkpoints is test_verify_judges_....
@pytest.mark.soak
def test_verify_after_a_kill_in_the_middle_of_a_save(tiny_mnist: Path, base_run: Path, tmp_path: Path) -> None:
    run_dir = _copy(base_run, tmp_path)
    proc = subprocess.Popen(command() + _args(run_dir, tiny_mnist, "--max-steps", "8"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env(**Faults(save_delay_s=120).to_env()),
                            stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _unfinished_payload(_step_dir(run_dir, 6)):  # payload written, manifest held back
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the save of step 6 never started"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()

    readers = [["verify", str(run_dir)], ["inspect", str(run_dir)], ["inspect", "--json", str(run_dir)]]
    with ThreadPoolExecutor(len(readers)) as pool:  # they only read the run dir: at the same time
        verified, inspected, as_json = pool.map(lambda args: run(args, name="resumable"), readers)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    lines = verified.stdout.splitlines()
    assert f"step 6: {UNFINISHED}" in lines and "step 4: ok" in lines and "step 2: ok" in lines, lines
    text = inspected.stdout
    assert any(UNFINISHED in line and line.split()[0] == "6" for line in text.splitlines()), text
    assert any("latest valid" in line and line.split()[0] == "4" for line in text.splitlines()), text
    data = json.loads(as_json.stdout)
    assert data["latest_valid"]["step"] == 4 and data["checkpoints"][-1]["committed"] is False

    resumed = _train(run_dir, tiny_mnist, "--max-steps", "8")  # and the run is fine: it resumes from step 4
    assert resumed.returncode == 0 and "resuming from step 4" in resumed.stderr, resumed.stderr
    assert UNFINISHED not in run(["verify", str(run_dir)], name="resumable").stdout


def _empty_unfinished(run_dir: Path) -> None:
    _step_dir(run_dir, 6).mkdir()


def _unfinished_behind_corrupt(run_dir: Path) -> None:
    shutil.copytree(_step_dir(run_dir, 4), _step_dir(run_dir, 6))
    (_step_dir(run_dir, 6) / fmt.MANIFEST).unlink()
    payload = shards(_step_dir(run_dir, 4))[0]
    replace_bytes(payload, payload.read_bytes()[:-10])  # a new file: the shard may be step 2's too (a hard link)


def _only_unfinished(run_dir: Path) -> None:
    for step in (2, 4):
        (_step_dir(run_dir, step) / fmt.MANIFEST).unlink()


@pytest.mark.parametrize("damage, code, message", [
    (_empty_unfinished, 0, None),
    (_unfinished_behind_corrupt, 1, "newest checkpoint (step 4) is not valid; the next start resumes from step 2"),
    (_only_unfinished, 2, "unfinished save"),
], ids=["empty-step-dir", "unfinished-behind-corrupt", "only-unfinished"])
def test_verify_judges_committed_checkpoints(base_run: Path, tmp_path: Path, damage, code: int,
                                             message: str | None) -> None:
    run_dir = _copy(base_run, tmp_path)
    damage(run_dir)
    result = CliRunner().invoke(main, ["verify", str(run_dir)])
    assert result.exit_code == code, result.output
    if message is not None:
        assert message in result.output, result.output
    unfinished = [line for line in result.output.splitlines() if UNFINISHED in line]
    assert unfinished and all(line.startswith(("step 2:", "step 4:", "step 6:")) for line in unfinished)
    assert "Traceback" not in result.output
