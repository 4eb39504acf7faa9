"""`resumable run` (issue 34, item 4): the supervisor's decisions without processes, then real scripts under it."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import command, env, final_fingerprint

from resumable.config import RunOptions
from resumable.engine.loop.preemption import session_budget
from resumable.errors import EXIT_CRASH_LOOP, EXIT_RESUME, ResumableError
from resumable.platforms import DEADLINE_ENV
from resumable.tools.supervise import (
    Policy,
    Supervisor,
    backoff_s,
    child_command,
    classify,
    deadline_for,
    too_little_left,
)

# A resumable script: a tiny model on synthetic data, 24 steps, a checkpoint every 2 steps. argv: RUN_DIR MARKS
# [FAULTS], FAULTS like "exit:5,raise:9,hang:13": each fault happens once (a marker file in MARKS remembers it) at
# that step; "always:5" raises at step 5 every time. "slow" sleeps in each step. It prints "step N" as it trains.
SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch
    import resumable

    run_dir, marks = sys.argv[1], Path(sys.argv[2])
    faults = [f.split(":") for f in sys.argv[3].split(",")] if len(sys.argv) > 3 and sys.argv[3] else []
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(96, 4), torch.randint(0, 2, (96,)))
    run = resumable.Run(run_dir, model=model, optimizer=optimizer, data=data, batch_size=8, epochs=2,
                        checkpointing=resumable.Checkpointing(steps=2), reporting=resumable.Reporting(progress=False),
                        session=resumable.Session(hang_timeout="2s"))
    for epoch, step, (x, y) in run:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        print(f"step {step}", flush=True)
        for i, (kind, at) in enumerate(faults):
            if kind == "slow":
                time.sleep(0.2)
            elif step == int(at) and (kind == "always" or not (marks / str(i)).exists()):
                (marks / str(i)).touch()
                if kind == "exit":
                    os._exit(1)  # killed without an end record
                if kind == "hang":
                    time.sleep(120)  # the watchdog ends it with exit 76 after 2 s
                raise RuntimeError(f"planted failure at step {step}")
    sys.exit(run.exit_code)
""")
FAST = ["--backoff", "0.1s", "--backoff-max", "0.2s"]


# -- decisions, no processes ----------------------------------------------------------------------------------
def test_exit_codes_are_classified() -> None:
    stops = {0: 0, 75: 75, 74: 74, 77: 77, 2: 2, 130: 130, -signal.SIGINT: 130}
    for returncode, code in stops.items():
        assert classify(returncode).restart is False and classify(returncode).code == code, returncode
    hang = classify(76)
    assert hang.restart and hang.code == 76 and "hung" in hang.reason and "hang-*.txt" in hang.reason
    assert classify(1).restart and "exception" in classify(1).reason
    assert classify(3).restart and "exit 3" in classify(3).reason
    killed = classify(-signal.SIGKILL)
    assert killed.restart and killed.code == 137 and "SIGKILL" in killed.reason
    assert classify(-signal.SIGSEGV).code == 139 and "SIGSEGV" in classify(-signal.SIGSEGV).reason


def test_backoff_doubles_up_to_its_cap_and_budget_refuses_a_short_restart() -> None:
    assert [backoff_s(n, 5, 60) for n in range(1, 6)] == [5, 10, 20, 40, 60]
    assert backoff_s(1000, 5, 60) == 60  # no overflow
    assert not too_little_left(None, 300, 60)  # no --time-limit
    assert not too_little_left(200, 10, 60) and too_little_left(65, 10, 60)


def test_deadline_is_the_earlier_of_the_limit_and_an_inherited_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEADLINE_ENV, raising=False)
    assert deadline_for(None, 1000.0) is None and deadline_for(60, 1000.0) == 1060.0
    monkeypatch.setenv(DEADLINE_ENV, "1030")
    assert deadline_for(60, 1000.0) == 1030.0 and deadline_for(None, 1000.0) == 1030.0
    monkeypatch.setenv(DEADLINE_ENV, "soon")
    with pytest.raises(ResumableError, match=DEADLINE_ENV):
        deadline_for(60, 1000.0)


def test_session_budget_honours_the_deadline_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEADLINE_ENV, f"{time.time() + 30:.3f}")  # rounded to the ms: up to 0.5 ms later
    assert 25 < session_budget(RunOptions()).remaining() <= 30.001  # no own limit: the deadline
    assert 25 < session_budget(RunOptions(time_limit="1h")).remaining() <= 30.001  # the earlier one
    assert session_budget(RunOptions(time_limit="10s")).remaining() <= 10
    monkeypatch.setenv(DEADLINE_ENV, f"{time.time() - 5:.3f}")  # passed: no step, a checkpoint and exit 75
    assert session_budget(RunOptions()).remaining() <= 0


def test_a_bad_target_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no script 'train.py'.*resumable run train.py"):
        child_command("train.py", [])
    with pytest.raises(ValueError, match="neither a script"):
        child_command("train", [])
    with pytest.raises(ValueError, match="not a function name"):
        child_command("pkg.mod:ma-in", [])
    (tmp_path / "train.py").write_text("")
    assert child_command("train.py", ["--lr", "3e-4"])[-3:] == [str(tmp_path / "train.py"), "--lr", "3e-4"]
    assert child_command("train.py:main", [])[-1] == f"{tmp_path / 'train.py'}:main"
    done = subprocess.run(command("resumable") + ["run", "missing.py"], capture_output=True, text=True,
                          env=env(), cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "no script 'missing.py'" in done.stderr


def _codes(tmp_path: Path, codes: list[int]) -> list[str]:
    """A script that exits with ``codes`` in turn, one per start (a counter file)."""
    counter = tmp_path / "count"
    script = tmp_path / "codes.py"
    script.write_text(f"import sys, pathlib\np = pathlib.Path({str(counter)!r})\nn = int(p.read_text()) if "
                      f"p.exists() else 0\np.write_text(str(n + 1))\nsys.exit({codes!r}[n])\n")
    return child_command(str(script), [])


def test_restarts_with_one_line_each_until_a_stop_or_exhaustion(tmp_path: Path) -> None:
    lines: list[str] = []
    waits: list[float] = []
    supervisor = Supervisor(_codes(tmp_path, [1, 76, 75]), Policy(max_restarts=5, backoff_s=0.01,
                            backoff_max_s=0.02), echo=lines.append, sleep=waits.append)
    assert supervisor.run() == EXIT_RESUME and supervisor.restarts == 2
    assert lines[0].startswith("resumable run: restart 1/5 in 0.0s: the script failed (exit 1")
    assert "restart 2/5" in lines[1] and "the script hung (exit 76" in lines[1] and len(lines) == 2

    lines.clear()
    (tmp_path / "count").unlink()
    supervisor = Supervisor(_codes(tmp_path, [3, 3, 3]), Policy(max_restarts=1, backoff_s=0.01),
                            echo=lines.append, sleep=waits.append)
    assert supervisor.run() == 3
    assert "all 1 restart(s) used" in lines[-1] and len(lines) == 2


def test_no_restart_when_too_little_of_the_time_limit_is_left(tmp_path: Path) -> None:
    shown = tmp_path / "deadline"
    script = tmp_path / "fails.py"
    script.write_text(f"import os, pathlib, sys\npathlib.Path({str(shown)!r}).write_text(os.environ["
                      f"{DEADLINE_ENV!r}])\nsys.exit(1)\n")
    done = subprocess.run(command("resumable") + ["run", "--time-limit", "1h", "--min-session", "2h", str(script)],
                          capture_output=True, text=True, env=env(), timeout=60)
    assert done.returncode == 1, done.stderr
    assert "not restarting" in done.stderr and "less than --min-session 2h" in done.stderr
    assert "restart 1/" not in done.stderr
    assert 3500 < float(shown.read_text()) - time.time() <= 3600  # the child got the absolute deadline


def test_module_function_gets_args_in_argv_and_its_return_is_the_exit_code(tmp_path: Path) -> None:
    (tmp_path / "mytrain.py").write_text("import sys\ndef main():\n    print('argv', sys.argv[1:])\n    return 3\n")
    done = subprocess.run(command("resumable") + ["run", "--max-restarts", "0", "mytrain:main", "--", "--lr", "3e-4"],
                          capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=60)
    assert done.returncode == 3, done.stderr
    assert "argv ['--lr', '3e-4']" in done.stdout  # passed through, not captured by the supervisor


# -- real resumable scripts -------------------------------------------------------------------------------------
def _script(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (tmp_path / "marks").mkdir()
    return script


def _supervise(script: Path, run_dir: Path, faults: str, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(command("resumable") + ["run", *options, str(script), "--", str(run_dir),
                                                  str(script.parent / "marks"), faults],
                          capture_output=True, text=True, env=env(), timeout=240, stdin=subprocess.DEVNULL)


def test_two_crashes_and_a_hang_end_with_the_uninterrupted_fingerprint(tmp_path: Path) -> None:
    script = _script(tmp_path)
    reference = tmp_path / "reference"
    straight = subprocess.run([sys.executable, str(script), str(reference), str(tmp_path / "marks")],
                              capture_output=True, text=True, env=env(), timeout=120)
    assert straight.returncode == 0, straight.stderr
    run_dir = tmp_path / "run"
    done = _supervise(script, run_dir, "exit:5,raise:9,hang:13", *FAST)
    assert done.returncode == 0, done.stderr
    restarts = [line for line in done.stderr.splitlines() if line.startswith("resumable run: restart")]
    assert len(restarts) == 3, done.stderr
    assert "exit 1" in restarts[0] and "exit 1" in restarts[1] and "the script hung (exit 76" in restarts[2]
    assert "step 23" in done.stdout  # the child's output passes through
    assert final_fingerprint(run_dir) == final_fingerprint(reference)


def test_a_crash_loop_stops_with_77(tmp_path: Path) -> None:
    script = _script(tmp_path)
    done = _supervise(script, tmp_path / "run", "always:5", "--max-restarts", "10", *FAST)
    assert done.returncode == EXIT_CRASH_LOOP, done.stderr
    assert "crash loop" in done.stderr
    assert done.stderr.count("resumable run: restart") == 4  # sessions 2-4 fail from step 4, the 5th refuses


def test_sigterm_is_forwarded_and_ends_the_supervision_with_75(tmp_path: Path) -> None:
    script = _script(tmp_path)
    run_dir = tmp_path / "run"
    supervisor = subprocess.Popen(command("resumable") + ["run", *FAST, str(script), "--", str(run_dir),
                                                          str(tmp_path / "marks"), "slow:0"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(),
                                  stdin=subprocess.DEVNULL)
    try:
        assert supervisor.stdout is not None
        for line in supervisor.stdout:
            if line.strip() == "step 3":
                break
        supervisor.send_signal(signal.SIGTERM)
        out, err = supervisor.communicate(timeout=120)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert supervisor.returncode == EXIT_RESUME, err
    assert "SIGTERM forwarded" in err and "not restarting" in err and "resumable run: restart" not in err
    assert "step 23" not in out
