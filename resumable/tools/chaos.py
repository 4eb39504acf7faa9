"""`resumable chaos`: kill a training run on purpose, restart it until done, and prove the result equals
an uninterrupted run (final fingerprint and metrics records).

What it runs is a :class:`Target`: `resumable-train` (the default), a Python function or script (warm restarts
through the fork server possible), or any command line (`torchrun ...`, a shell script). Whatever it is, it
must train with resumable into the run dir chaos hands it (``{run_dir}`` in its arguments): chaos reads that
dir's checkpoints and ``metrics.jsonl``, and times its kills from the engine's "training on" line.

The kills chain in one run: the first (and every ``mid_save_every``-th) lands inside a checkpoint write, the
second on the very first step after a resume (the session kills itself with SIGKILL right after that step,
through ``Faults.kill_at_step``), the others at random moments with the chosen signals.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checkpoint import CheckpointManager, checkpoints_dir
from ..checkpoint import format as fmt
from ..faults import FAULTS_ENV, Faults
from ..reporting.metrics import read_records, without_timing
from .forkserver import ForkServer
from .targets import Target

LAUNCH = [sys.executable, "-c", "import sys; from resumable.tools.forkserver import main; main(sys.argv[1:])"]
# A marker in each session's environment, inherited by everything it starts (DataLoader workers, torchrun's
# workers, which torchrun puts in sessions of their own): how chaos finds them all, orphans included, to
# SIGKILL them together and to wait for them before the next start. Never read by the engine.
SESSION_ENV = "RESUMABLE_CHAOS_SESSION"
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}


@dataclass
class Kill:
    number: int
    signal: str
    mid_save: bool
    step_at_kill: int
    first_step: bool = False  # killed on the very first step after a resume
    resumed_from: int | None = None
    steps_lost: int | None = None
    restart_to_first_step_s: float | None = None


@dataclass
class ChaosReport:
    verdict: str  # IDENTICAL or DIVERGED
    difference: str | None
    kills: list[Kill] = field(default_factory=list)
    chaos_wall_s: float = 0.0
    reference_wall_s: float = 0.0
    fingerprint: str | None = None
    reference_fingerprint: str | None = None
    unloadable_checkpoints: int = 0
    kills_planned: int = 0

    @property
    def goodput(self) -> float:
        return self.reference_wall_s / self.chaos_wall_s if self.chaos_wall_s else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "goodput": self.goodput}


def _max_step(run_dir: Path) -> int:
    return max((r.get("step", 0) for r in read_records(run_dir / "metrics.jsonl")), default=0)


def _saving(run_dir: Path) -> bool:
    return any(not (p / fmt.MANIFEST).exists() and _has_entries(p)
               for _, p in CheckpointManager(checkpoints_dir(run_dir)).step_dirs())


def _has_entries(directory: Path) -> bool:
    """Whether a save has written anything into ``directory`` yet (a pruned one is gone: False)."""
    try:
        return any(True for _ in directory.iterdir())
    except OSError:
        return False


def _latest(run_dir: Path) -> tuple[str | None, int]:
    """Fingerprint of the newest valid checkpoint and the number of committed-but-invalid ones."""
    infos = CheckpointManager(checkpoints_dir(run_dir)).inspect(deep=True)
    bad = sum(1 for i in infos if i.committed and not i.valid)
    latest = next((i for i in reversed(infos) if i.valid), None)
    return (latest.fingerprint if latest else None), bad


def _newest_step(run_dir: Path) -> int:
    latest, _ = CheckpointManager(checkpoints_dir(run_dir)).latest_valid()
    return latest.step if latest is not None else 0


def _resumed_from(stderr: str) -> int | None:
    marker = "resuming from step "
    if marker not in stderr:
        return 0 if "training on" in stderr else None
    return int(stderr.split(marker, 1)[1].split()[0])


def _session_pids(tag: str) -> list[int]:
    """Live processes of one session (its environment has ``SESSION_ENV=tag``); none where /proc is missing."""
    needle = f"{SESSION_ENV}={tag}".encode()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    pids = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # gone, or not ours to read
            continue
        if state not in ("Z", "X"):  # a zombie has exited; its parent (maybe init) reaps it
            pids.append(int(entry))
    return pids


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Chaos:
    """``target``: a :class:`Target`, or the arguments of `resumable-train`."""

    def __init__(self, target: Target | Sequence[str], workdir: Path, kills: int, signal_mode: str, seed: int,
                 every_s: float, mid_save_every: int = 3, extra_env: dict[str, str] | None = None,
                 echo=print, warm: bool = False, parallel_reference: bool = False) -> None:
        self.target = target if isinstance(target, Target) else Target("resumable-train", tuple(target))
        if warm and self.target.kind == "command":
            raise ValueError("--warm forks a Python process that imported torch; a command starts afresh each time")
        self.workdir = workdir
        self.kills = kills
        self.signal_mode = signal_mode
        self.rng = random.Random(seed)
        self.every_s = every_s
        self.mid_save_every = mid_save_every
        self.extra_env = extra_env or {}
        self.echo = echo
        self.warm = warm
        self.parallel_reference = parallel_reference
        self._servers: list[ForkServer] = []
        self._own_reference = True
        self._numbers = itertools.count(1)
        self._live: set[str] = set()  # tags of sessions that may still have processes

    def _spawn(self, run_dir: Path, extra: dict[str, str], server: int = 0):
        """Start one session; returns the process and the session's tag."""
        tag = f"{os.getpid()}.{next(self._numbers)}"
        # Its kills are on purpose, often before a session commits anything: never a crash loop (engine/crashloop.py).
        # The faults of both sources together (a session's own faults must not drop --break-rng-restore's).
        faults = {**json.loads(self.extra_env.get(FAULTS_ENV) or "{}"), **json.loads(extra.get(FAULTS_ENV) or "{}"),
                  "ignore_crash_loop": True}
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env, **extra, FAULTS_ENV: json.dumps(faults),
               SESSION_ENV: tag}
        # One record per step, so "step at kill" is exact (both runs get it, so records still compare); not
        # with a user's --reference, whose records were written with the options as given.
        chosen = self._own_reference and not any(a.startswith("--log-every") for a in self.target.args)
        args = self.target.arguments(run_dir, chosen)
        self._live.add(tag)
        if self._servers:
            return self._servers[server].spawn(args, env), tag
        command = args if self.target.kind == "command" else [*LAUNCH, self.target.python, *args]
        try:
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                    stdin=subprocess.DEVNULL)
        except OSError as e:
            raise RuntimeError(f"cannot start {command[0]!r}: {e}") from e
        return proc, tag

    @staticmethod
    def _kill(proc, tag: str) -> None:
        """SIGKILL the session's process and everything it started at once, as a VM going away does."""
        others = [pid for pid in _session_pids(tag) if pid != proc.pid]
        proc.send_signal(signal.SIGKILL)
        _kill_all(others)

    def _settle(self, tag: str, timeout: float = 60.0) -> None:
        """Wait until every process of an ended session is gone (torchrun's workers may still be saving; a
        DataLoader worker leaves soon after its parent), so no two sessions ever share the run dir."""
        deadline = time.monotonic() + timeout
        while pids := _session_pids(tag):
            if time.monotonic() > deadline:
                _kill_all(pids)
                if time.monotonic() > deadline + 10:
                    raise RuntimeError(f"processes {pids} of an ended session do not exit, even on SIGKILL")
            time.sleep(0.02)
        self._live.discard(tag)

    @staticmethod
    def _collect(proc, lines: list[tuple[float, str]]) -> threading.Thread:
        """Read the child's stderr as it comes, with arrival times (to time the restart)."""
        def read() -> None:
            for line in proc.stderr:
                lines.append((time.monotonic(), line))

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        return thread

    def run_interrupted(self, run_dir: Path) -> tuple[list[Kill], float]:
        kills: list[Kill] = []
        wall = 0.0
        while True:
            number = len(kills) + 1
            killing = number <= self.kills
            mid_save = killing and self.mid_save_every > 0 and number % self.mid_save_every == 1
            # The first kill after a resume lands on the very first step that session trains: the process kills
            # itself (SIGKILL) right after that step, before anything of it can be saved.
            first_step = killing and not mid_save and number == 2
            name = self.rng.choice(list(SIGNALS)) if self.signal_mode == "mix" else self.signal_mode
            delay = self.rng.uniform(0.3, 1.7) * self.every_s
            started = time.monotonic()
            # A mid-save session writes each checkpoint slowly, so that its kill lands between payload and
            # manifest; the window is short enough that async saves barely slow its training.
            faults = (Faults(save_delay_s=0.3) if mid_save else
                      Faults(kill_at_step=_newest_step(run_dir) + 1) if first_step else None)
            proc, tag = self._spawn(run_dir, faults.to_env() if faults is not None else {})
            lines: list[tuple[float, str]] = []
            reader = self._collect(proc, lines)
            if killing and not first_step:
                # The delay counts from the first step of this session, so kills land in training; a
                # mid-save kill waits for the first checkpoint write that starts after the delay.
                while proc.poll() is None and time.monotonic() - started < 600:
                    ready = next((t for t, line in lines if "training on" in line), None)
                    due = ready is not None and time.monotonic() >= ready + delay
                    if due and (not mid_save or _saving(run_dir)):
                        break
                    time.sleep(0.005)
                if proc.poll() is None and (mid_save or name == "KILL"):
                    self._kill(proc, tag)
                elif proc.poll() is None:  # TERM and INT go to the process, as from `kill` or a launcher
                    proc.send_signal(SIGNALS[name])
            proc.wait()
            self._settle(tag)
            inside_save = mid_save and _saving(run_dir)  # confirm the kill did land inside a write
            reader.join()
            stderr = "".join(line for _, line in lines)
            wall += time.monotonic() - started
            if kills:
                # "training on …" is printed after the restore, right before the first step.
                ready = next((t for t, line in lines if "training on" in line), None)
                kills[-1].restart_to_first_step_s = ready - started if ready is not None else None
                kills[-1].resumed_from = _resumed_from(stderr)
                if kills[-1].resumed_from is not None:
                    kills[-1].steps_lost = max(kills[-1].step_at_kill - kills[-1].resumed_from, 0)
            if proc.returncode == 0:
                return kills, wall
            if proc.returncode not in (75, -signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT, 130, 1):
                raise RuntimeError(f"training failed with exit code {proc.returncode}:\n{stderr[-2000:]}")
            if not killing and proc.returncode not in (75,):
                raise RuntimeError(f"training failed with exit code {proc.returncode}:\n{stderr[-2000:]}")
            at = faults.kill_at_step if first_step else _max_step(run_dir)
            kills.append(Kill(number, "KILL" if mid_save or first_step else name, inside_save, at,
                              first_step=first_step))
            self.echo(f"kill {number}: SIG{kills[-1].signal} at step {kills[-1].step_at_kill}"
                      f"{' (inside a checkpoint write)' if inside_save else ''}"
                      f"{' (the first step after the resume)' if first_step else ''}")

    def _start_reference(self, run_dir: Path) -> threading.Thread:
        """Run the uninterrupted reference in a thread; its result lands in ``self._reference``."""
        def reference() -> None:
            started = time.monotonic()
            try:
                proc, tag = self._spawn(run_dir, {}, server=len(self._servers) - 1)
                _, stderr = proc.communicate()
                self._settle(tag)
                self._reference = (proc.returncode, stderr, time.monotonic() - started)
            except RuntimeError as e:
                self._reference = (None, str(e), time.monotonic() - started)

        thread = threading.Thread(target=reference, daemon=True)
        thread.start()
        return thread

    def run(self, reference: Path | None) -> ChaosReport:
        self._own_reference = reference is None
        try:
            if self.warm:  # the parallel reference gets a server of its own: one child per server
                for _ in range(2 if self.parallel_reference else 1):
                    self._servers.append(ForkServer(self.target.python))
            return self._run(reference)
        finally:
            for tag in list(self._live):  # chaos itself stopped (Ctrl-C, an error): leave no training behind
                _kill_all(_session_pids(tag))
            self._live.clear()
            for server in self._servers:
                server.close()
            self._servers = []

    def _run(self, reference: Path | None) -> ChaosReport:
        chaos_dir = self.workdir / "chaos"
        ref_thread = None
        if reference is None and self.parallel_reference:
            reference = self.workdir / "reference"
            ref_thread = self._start_reference(reference)
        kills, chaos_wall = self.run_interrupted(chaos_dir)
        ref_wall = 0.0
        if reference is None:
            reference = self.workdir / "reference"
            ref_thread = self._start_reference(reference)
        if ref_thread is not None:
            ref_thread.join()
            code, stderr, ref_wall = self._reference
            if code != 0:
                raise RuntimeError(f"the uninterrupted reference run failed:\n{stderr[-2000:]}")
        fp, bad = _latest(chaos_dir)
        ref_fp, _ = _latest(reference)
        mine = without_timing(read_records(chaos_dir / "metrics.jsonl"))
        theirs = without_timing(read_records(reference / "metrics.jsonl"))
        difference = None
        if fp != ref_fp:
            difference = f"final fingerprint {fp} != uninterrupted {ref_fp}"
        elif mine != theirs:
            index = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                         min(len(mine), len(theirs)))
            difference = (f"metrics record {index} differs: {mine[index] if index < len(mine) else None} != "
                          f"{theirs[index] if index < len(theirs) else None}")
        return ChaosReport("IDENTICAL" if difference is None else "DIVERGED", difference, kills, chaos_wall,
                           ref_wall, fp, ref_fp, bad, self.kills)


def format_report(report: ChaosReport) -> str:
    lines = [f"{'kill':>4} {'signal':>7} {'step at kill':>12} {'resumed from':>12} {'steps lost':>10} "
             f"{'restart→first step':>18}"]
    for k in report.kills:
        restart = f"{k.restart_to_first_step_s:.2f}s" if k.restart_to_first_step_s is not None else "-"
        mark = "*" if k.mid_save else "^" if k.first_step else " "
        lines.append(f"{k.number:>4} {'SIG' + k.signal:>7}{mark}{k.step_at_kill:>12} "
                     f"{k.resumed_from if k.resumed_from is not None else '-':>12} "
                     f"{k.steps_lost if k.steps_lost is not None else '-':>10} {restart:>18}")
    lost = [k.steps_lost for k in report.kills if k.steps_lost is not None]
    lines.append("(* = killed inside a checkpoint write, ^ = on the first step after a resume)")
    if len(report.kills) < report.kills_planned:
        lines.append(f"the run finished after {len(report.kills)} of the {report.kills_planned} kills asked for "
                     f"(a longer run, e.g. a higher --max-steps, or a shorter --every fits them all)")
    if report.reference_wall_s:
        lines.append(f"goodput {100 * report.goodput:.1f}% (uninterrupted {report.reference_wall_s:.1f}s / "
                     f"interrupted {report.chaos_wall_s:.1f}s wall)")
    lines.append(f"lost work per kill: {sum(lost) / len(lost) if lost else 0:.1f} steps on average; "
                 f"unloadable checkpoints: {report.unloadable_checkpoints}")
    verdict = report.verdict if report.difference is None else f"{report.verdict}: {report.difference}"
    lines.append(verdict)
    return "\n".join(lines)


def report_json(report: ChaosReport) -> str:
    return json.dumps(report.to_json(), indent=2)
