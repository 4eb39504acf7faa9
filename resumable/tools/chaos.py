"""`resumable chaos`: kill a training run on purpose, restart it until done, and prove the result equals
an uninterrupted run (final fingerprint and metrics records).

What it runs is a :class:`Target`: `resumable-train` (the default), a Python function or script (warm restarts
through the fork server possible), or any command line (`torchrun ...`, a shell script). Whatever it is, it
must train with resumable into the run dir chaos hands it (``{run_dir}`` in its arguments): chaos reads that
dir's checkpoints and ``metrics.jsonl``, and times its kills from the engine's "training on" line.

The faults (tools/faultkinds.py) chain in one run. With kills in the mix (``--fault kill|term|int|mix``, or
``--signal``), the first (and every ``mid_save_every``-th) is a SIGKILL inside a checkpoint write and the second a
SIGKILL on the very first step after a resume (the session kills itself right after that step, through
``Faults.kill_at_step``); the others are drawn at random moments. A fault that does not end the session
(stop-cont, writer-error) is followed by the next one in the same session.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ..checkpoint import CheckpointManager, checkpoints_dir
from ..checkpoint import format as fmt
from ..errors import EXIT_NOT_DURABLE, EXIT_RESUME
from ..faults import FAULTS_ENV, Faults, held_marker
from ..reporting.metrics import read_records, without_timing
from .chaos_drive import DriveRuns, drive_run_dir
from .chaos_report import ChaosReport, Kill, format_report, report_json
from .faultkinds import (
    KINDS,
    SAVE_ERROR_MARK,
    SIGNAL_KINDS,
    STOP_CONT_PAUSE_S,
    FaultKind,
    draw,
    exit_codes,
    killed_workers,
    pool,
)
from .forkserver import ForkServer
from .sessions import SESSION_ENV, _kill_all, _session_pids, _signal
from .targets import Target

__all__ = ["SESSION_ENV", "Chaos", "ChaosReport", "Kill", "Target", "format_report", "report_json"]

LAUNCH = [sys.executable, "-c", "import sys; from resumable.tools.forkserver import main; main(sys.argv[1:])"]
HANG_TIMEOUT = "5s"  # what resumable-train gets under --fault hang|mix unless its arguments say otherwise
SHORT = {"kill": "KILL", "term": "TERM", "int": "INT", "stop-cont": "STOP", "segfault": "SEGV", "hang": "HANG",
         "writer-error": "EIO"}


def _max_step(run_dir: Path) -> int:
    return max((r.get("step", 0) for r in read_records(run_dir / "metrics.jsonl")), default=0)


def _saving(run_dir: Path) -> bool:
    return any(not (p / fmt.MANIFEST).exists() and _has_entries(p)
               for _, p in CheckpointManager(checkpoints_dir(run_dir)).step_dirs())


def _held(hold: Path) -> bool:
    """Arm the hold (Faults.save_hold_file) and say whether a save is held by it."""
    hold.touch()
    return os.path.exists(held_marker(hold))


def _release(hold: Path) -> None:
    for path in (hold, Path(held_marker(hold))):
        path.unlink(missing_ok=True)


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


class Chaos:
    """``target``: a :class:`Target`, or the arguments of `resumable-train`."""

    def __init__(self, target: Target | Sequence[str], workdir: Path, kills: int, mode: str, seed: int,
                 every_s: float, mid_save_every: int = 3, extra_env: dict[str, str] | None = None,
                 echo=print, warm: bool = False, parallel_reference: bool = False) -> None:
        self.target = target if isinstance(target, Target) else Target("resumable-train", tuple(target))
        if warm and self.target.kind == "command":
            raise ValueError("--warm forks a Python process that imported torch; a command starts afresh each time")
        self.workdir = workdir
        self.kills = kills
        self.mode = {"KILL": "kill", "TERM": "term", "INT": "int"}.get(mode, mode)  # --signal's names too
        if self.mode not in (*KINDS, "mix", "signals"):
            raise ValueError(f"unknown fault {mode!r}: one of {', '.join(KINDS)}, mix")
        self.rng = random.Random(seed)
        on_drive = drive_run_dir(self.target, workdir / "chaos") is not None
        if self.mode == "drive" and not on_drive:
            raise ValueError("--fault drive fails the run's Drive API calls, and its run dir is local: write a Drive "
                             "one in the training options, e.g. -- --run-dir gdrive://root/chaos-test/{run_dir}")
        env = {**os.environ, **(extra_env or {})}
        self.drive = DriveRuns(self.target, workdir, self.rng, env) if on_drive else None
        self.every_s = every_s
        self.mid_save_every = mid_save_every
        self.extra_env = extra_env or {}
        self.echo = echo
        self.warm = warm
        self.parallel_reference = parallel_reference
        self._servers: list[ForkServer] = []
        self._own_reference = True
        self._numbers = itertools.count(1)
        self._first_step_done = False
        self._deck: list[str] = []  # the fault kinds a mix has not drawn yet (faultkinds.draw)
        self._live: set[str] = set()  # tags of sessions that may still have processes

    def _spawn(self, run_dir: Path, extra: dict[str, str], server: int = 0):
        """Start one session; returns the process and the session's tag."""
        tag = f"{os.getpid()}.{next(self._numbers)}"
        # Its kills are on purpose, often before a session commits anything: never a crash loop
        # (engine/rundir/crash_loop.py).
        # The faults of both sources together (a session's own faults must not drop --break-rng-restore's).
        faults = {**json.loads(self.extra_env.get(FAULTS_ENV) or "{}"), **json.loads(extra.get(FAULTS_ENV) or "{}"),
                  "ignore_crash_loop": True}
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env, **extra,
               **Faults(**faults).to_env(),  # and chaos's child bootstrap on PYTHONPATH, for command targets too
               SESSION_ENV: tag}
        # One record per step, so "step at kill" is exact (both runs get it, so records still compare); not
        # with a user's --reference, whose records were written with the options as given.
        chosen = self._own_reference and not any(a.startswith("--log-every") for a in self.target.args)
        args = self.target.arguments(run_dir, chosen)
        args = self.drive.arguments(args) if self.drive is not None else args
        if (self.target.kind == "resumable-train" and "hang" in pool(self.mode)
                and not any(a.startswith("--hang-timeout") for a in self.target.args)):
            args = [*args, "--hang-timeout", HANG_TIMEOUT]  # else a planted hang waits out the 5 min default
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

    def _delay(self) -> float:
        return self.rng.uniform(0.3, 1.7) * self.every_s

    def _first_fault(self, number: int, run_dir: Path) -> tuple[FaultKind | None, bool, bool]:
        """A session's first fault: (kind, inside a save, on the first step after a resume); None: no more. The
        first-step kill comes second, or later when no checkpoint was committed yet (it needs one to resume from,
        else it would be one more kill of a fresh start)."""
        if number > self.kills:
            return None, False, False
        kills = self.mode in ("mix", "signals", *SIGNAL_KINDS)
        mid_save = kills and self.mid_save_every > 0 and number % self.mid_save_every == 1
        first_step = (kills and not mid_save and number >= 2 and not self._first_step_done
                      and _newest_step(run_dir) > 0)
        self._first_step_done |= first_step
        if mid_save or first_step:
            return KINDS["kill"], mid_save, first_step
        return draw(self.mode, self.rng, fresh=True, drive=self.drive is not None, deck=self._deck), False, False

    def _next_fault(self, number: int) -> FaultKind | None:
        """The fault after one that left the session running."""
        if number > self.kills:
            return None
        try:
            return draw(self.mode, self.rng, fresh=False, drive=self.drive is not None, deck=self._deck)
        except LookupError:
            return None

    def run_interrupted(self, run_dir: Path) -> tuple[list[Kill], float]:
        kills: list[Kill] = []
        wall = 0.0
        if "segfault" in pool(self.mode):  # a SIGSEGV must not leave core files behind
            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        while True:
            started = time.monotonic()
            code = self._session(run_dir, kills)
            wall += time.monotonic() - started
            if code == 0:
                return kills, wall

    def _local(self, run_dir: Path) -> Path:
        """Where a scratch run's checkpoints and metrics are read: the run dir, or a Drive run's local cache."""
        return self.drive.local(run_dir) if self.drive is not None else run_dir

    def _session(self, run_dir: Path, kills: list[Kill]) -> int:
        """Run one session to its end, injecting its faults (appended to ``kills``); returns its exit code."""
        number = len(kills) + 1
        local = self._local(run_dir)  # the session is told run_dir; chaos reads local
        current, mid_save, first_step = self._first_fault(number, local)
        delay = self._delay()
        # A mid-save session's saves are held before their manifest once the kill is due (the hold file exists):
        # the kill lands between payload and manifest however late this process is scheduled, and no save is
        # slowed before then.
        hold = self.workdir / f"hold-{os.getpid()}-{number}"
        faults = (Faults(save_hold_file=str(hold)) if mid_save else
                  Faults(kill_at_step=_newest_step(local) + 1) if first_step else
                  Faults(hang_after_s=delay) if current is KINDS["hang"] else
                  Faults(save_error_after_s=delay) if current is KINDS["writer-error"] else None)
        started = time.monotonic()
        drive = self.drive.session_env() if self.drive is not None and "drive" in pool(self.mode, True) else {}
        proc, tag = self._spawn(run_dir, {**(faults.to_env() if faults is not None else {}), **drive})
        lines: list[tuple[float, str]] = []
        reader = self._collect(proc, lines)
        inside = first_step or (current is not None and current.armed)  # fires inside the session
        ended_by = current if inside else None
        since: float | None = None  # delays count from the first step, then from the previous fault
        while proc.poll() is None:
            if current is KINDS["writer-error"]:  # armed: the session goes on after it, to the next (external) fault
                if any(SAVE_ERROR_MARK in line for _, line in lines):
                    kills.append(Kill(number, "EIO", False, _max_step(local), fault=current.name, ended_session=False))
                    self.echo(f"fault {number}: a checkpoint write failed with EIO at step {kills[-1].step_at_kill}")
                    number += 1
                    current, since, delay = self._next_fault(number), time.monotonic(), self._delay()
                    inside, ended_by = False, None
                time.sleep(0.01)
                continue
            if current is None or inside:  # nothing more to inject, or an armed fault that fires inside
                time.sleep(0.01)
                continue
            since = since if since is not None else next((t for t, line in lines if "training on" in line), None)
            if since is None or time.monotonic() < since + delay:
                time.sleep(0.005)
                continue
            if mid_save and not _held(hold):  # the next save to reach its manifest waits there to be killed
                time.sleep(0.005)
                continue
            if current.drive:  # fail its next Drive call; it goes on
                assert self.drive is not None
                kill = self.drive.inject(number, lambda: proc.poll() is None, lambda: _max_step(local))
                if kill is None:  # it ended first
                    break
                kills.append(kill)
                self.echo(f"fault {number}: Drive {kill.signal} at step {kill.step_at_kill}: {kill.cost} ({kill.note})")
                number += 1
                current, since, delay = self._next_fault(number), time.monotonic(), self._delay()
                continue
            if not current.ends_session:  # stop-cont: freeze every process of the session, then let it go on
                paused = self._stop_cont(proc, tag)
                kills.append(Kill(number, "STOP", False, _max_step(local), fault=current.name,
                                  ended_session=False, paused_s=paused))
                self.echo(f"fault {number}: SIGSTOP for {paused:.2f}s at step {kills[-1].step_at_kill}, then SIGCONT")
                number += 1
                current, since, delay = self._next_fault(number), time.monotonic(), self._delay()
                continue
            if current.signal == signal.SIGKILL:
                self._kill(proc, tag)
            else:  # TERM, INT and SEGV go to the process, as from `kill`, a launcher or a bad pointer
                proc.send_signal(current.signal)
            ended_by = current
            break
        proc.wait()
        ended = time.monotonic()
        self._settle(tag)
        inside_save = mid_save and _saving(local)  # confirm the kill did land inside a write
        _release(hold)
        reader.join()
        stderr = "".join(line for _, line in lines)
        self._note_restart(kills, started, lines, stderr)
        code = proc.returncode
        # Done, or a session that ran out of time; or one whose newest checkpoint was not on Drive by its end
        # (EXIT_NOT_DURABLE, after Drive faults): not a success, so run_interrupted starts another session, which
        # uploads it (or trains on) and only then can end 0.
        if code == 0 or (ended_by is None and code in (EXIT_RESUME, EXIT_NOT_DURABLE)):
            return code
        launcher = self.target.kind == "command" and killed_workers(ended_by, code, stderr)
        if ended_by is None or (code not in exit_codes(ended_by) and not launcher):
            raise RuntimeError(f"training failed with exit code {code}:\n{stderr[-2000:]}")
        at = faults.kill_at_step if first_step and faults is not None else _max_step(local)
        kills.append(Kill(number, SHORT[ended_by.name], inside_save, at, first_step=first_step, fault=ended_by.name))
        if ended_by is KINDS["hang"]:  # armed to hang `delay` after the first step; the watchdog ended it
            first = next((t for t, line in lines if "training on" in line), None)
            kills[-1].detected_s = ended - (first + delay) if first is not None else None
        how = f" (SIG{kills[-1].signal})" if ended_by.signal else ""
        self.echo(f"fault {number}: {ended_by.name}{how} at step {at}"
                  f"{' (inside a checkpoint write)' if inside_save else ''}"
                  f"{' (the first step after the resume)' if first_step else ''}")
        return code

    def _stop_cont(self, proc, tag: str) -> float:
        """SIGSTOP every process of the session (a VM frozen by its host), wait, SIGCONT them; the seconds."""
        pids = _session_pids(tag) or [proc.pid]
        pause = self.rng.uniform(*STOP_CONT_PAUSE_S)
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        time.sleep(pause)
        for pid in pids:
            _signal(pid, signal.SIGCONT)
        return pause

    @staticmethod
    def _note_restart(kills: list[Kill], started: float, lines: list[tuple[float, str]], stderr: str) -> None:
        """Fill in how the session after a fault that ended one resumed: from which step, how fast."""
        pending = next((k for k in reversed(kills) if k.ended_session), None)
        if pending is None or pending.resumed_from is not None:
            return
        # "training on …" is printed after the restore, right before the first step.
        ready = next((t for t, line in lines if "training on" in line), None)
        pending.restart_to_first_step_s = ready - started if ready is not None else None
        pending.resumed_from = _resumed_from(stderr)
        if pending.resumed_from is not None:
            pending.steps_lost = max(pending.step_at_kill - pending.resumed_from, 0)

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
            if self.drive is not None:
                self.drive.close()
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
        reference = self._local(reference) if self._own_reference else reference
        fp, bad = _latest(self._local(chaos_dir))
        ref_fp, _ = _latest(reference)
        mine = without_timing(read_records(self._local(chaos_dir) / "metrics.jsonl"))
        theirs = without_timing(read_records(reference / "metrics.jsonl"))
        difference = None
        # On Drive, the newest checkpoint must be durable there: restored into a fresh cache, it is the same one.
        on_drive = _latest(self.drive.restore(chaos_dir, "from-drive"))[0] if self.drive is not None else None
        if fp != ref_fp:
            difference = f"final fingerprint {fp} != uninterrupted {ref_fp}"
        elif self.drive is not None and on_drive != fp:
            difference = f"the newest checkpoint restored from Drive has fingerprint {on_drive}, not {fp}"
        elif mine != theirs:
            index = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                         min(len(mine), len(theirs)))
            difference = (f"metrics record {index} differs: {mine[index] if index < len(mine) else None} != "
                          f"{theirs[index] if index < len(theirs) else None}")
        return ChaosReport("IDENTICAL" if difference is None else "DIVERGED", difference, kills, chaos_wall,
                           ref_wall, fp, ref_fp, bad, self.kills, on_drive)
