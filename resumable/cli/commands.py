"""The ``resumable`` command group: inspect, verify, chaos, run, drive-login, and the lazily imported export,
torchrun and plot."""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from ..config import parse_duration
from ..errors import ResumableError
from .exits import echo_err, exit_with, fail
from .params import Duration


def checkpoint_status(entry: dict[str, Any]) -> str:
    """The status column of ``resumable inspect`` for one local or remote checkpoint entry."""
    from ..storage.placement import HOLDER

    if entry["valid"]:
        status = "durable on Drive" if entry.get("durable") else "valid"
        if entry.get("durable") and entry.get("checked"):  # say how far "durable" was checked
            status += f" ({entry['checked']} checked)"
    elif entry.get("committed") is False:
        status = "unfinished save (no manifest; ignored, removed at the next start)"
    elif entry["reason"] == HOLDER:  # a pruned remote checkpoint whose shards newer ones use: no damage
        status = f"pruned: {entry['reason']}"
    else:
        status = f"INVALID: {entry['reason']}"
    return status + (f" ({entry['note']})" if entry.get("note") else "")



class _LazyGroup(click.Group):
    """A group whose heavy commands are imported only when asked for (click's lazy-loading pattern)."""

    lazy_commands: dict[str, str] = {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy_commands and name not in self.commands:
            module, _, attribute = self.lazy_commands[name].partition(":")
            self.add_command(getattr(importlib.import_module(module), attribute), name)
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """resumable: training that survives being killed. See `resumable-train --help` to train."""


@main.command()
@click.argument("run_dir")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--drive-credentials", type=click.Path(dir_okay=False), default=None,
              help="Credentials for gdrive:// run dirs (see resumable-train --help).")
@click.option("--deep", is_flag=True,
              help="For a Drive run dir: download every file of each durable checkpoint and check its sha256 "
                   "(a local run dir is always hashed).")
def inspect(run_dir: str, as_json: bool, drive_credentials: str | None, deep: bool) -> None:
    """List the checkpoints of RUN_DIR: step, epoch, time, size, valid or why not.

    For a Drive run dir (gdrive:// or a mounted Drive folder) it lists what is on Drive and whether each
    checkpoint is durable there (every file uploaded and verified, then its manifest), and what was checked:
    sizes, and the md5 Drive reports against the one the manifest records, without downloading; --deep
    downloads and checks each file's sha256.
    """
    from ..checkpoint import CheckpointManager, checkpoints_dir
    from ..checkpoint.retention import best_entry
    from ..reporting.history import SESSIONS, read_sessions
    from ..storage import StorageError, open_run_location
    from ..storage.tiered import describe_remote

    try:
        location = open_run_location(run_dir, credentials=drive_credentials)
        if location.remote is not None:
            with tempfile.TemporaryDirectory() as scratch:
                entries = describe_remote(location.remote, Path(scratch), deep=deep)
                if SESSIONS in location.remote.list_files(""):
                    location.remote.get_file("", SESSIONS, Path(scratch) / SESSIONS)
                sessions = read_sessions(Path(scratch))
        else:
            # A folder without a manifest is not a checkpoint (a save killed half-way): listed, never judged.
            entries = [{**i.to_json(), "committed": i.committed, "format_version": i.format_version, "note": i.note}
                       for i in CheckpointManager(checkpoints_dir(run_dir)).inspect(deep=True)]
            sessions = read_sessions(Path(run_dir))
    except (StorageError, ValueError) as e:  # ValueError: a malformed or misspelt Drive URL, named with the fix
        fail(str(e))
    latest = next((e for e in reversed(entries) if e["valid"]), None)
    rule, best = best_entry(entries)
    if as_json:
        chosen = {"monitor": rule.monitor, "mode": rule.mode, "step": best["step"] if best else None,
                  "value": rule.value(best["metrics"]) if best else None}
        click.echo(json.dumps({"run_dir": run_dir, "checkpoints": entries, "latest_valid": latest, "best": chosen,
                               "sessions": [s.to_json() for s in sessions]}, indent=2))
        return
    if not entries:
        click.echo(f"no checkpoints in {run_dir}")
    else:
        click.echo(f"{'step':>10} {'epoch':>6} {'created':>20} {'size':>10}  status")
    for entry in entries:
        created = _clock(entry["created"])
        size = f"{entry['size'] / 1e6:8.2f}MB" if entry.get("size") is not None else "-"
        status = checkpoint_status(entry)
        marker = "  <- latest valid" if entry is latest else ""
        if entry is best:
            direction = "highest" if rule.mode == "max" else "lowest"
            marker += f"  <- best ({rule.monitor} {rule.value(entry['metrics']):.6g}, {direction})"
        epoch = entry["epoch"] if entry["epoch"] is not None else "-"
        click.echo(f"{entry['step']:>10} {epoch:>6} {created:>20} {size:>10}  {status}{marker}")
    if sessions:
        click.echo(f"\n{'session':>7} {'started':>20} {'ended':>20} {'steps':>15}  how it ended")
    for s in sessions:
        steps = f"{s.start_step} → {s.end_step if s.end_step is not None else '?'}"
        device = f" (on {s.device})" if s.device else ""
        click.echo(f"{s.session:>7} {_clock(s.start):>20} {_clock(s.end):>20} {steps:>15}  {s.how}{device}")


def _clock(unix: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix)) if unix else "-"


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--target", default="resumable-train", show_default=True, metavar="TARGET",
              help="What to run: resumable-train; MODULE:FUNCTION or FILE.py:FUNCTION (called with the "
                   "argument list); FILE.py (run like `python FILE.py ARGS`); or command (ARGS is a whole "
                   "command line, e.g. torchrun ...). Except for resumable-train, write {run_dir} in ARGS "
                   "where the run dir goes.")
@click.option("--kills", type=click.IntRange(min=0), default=5, show_default=True,
              help="How many faults to inject (most kill the session).")
@click.option("--fault", type=click.Choice(("kill", "term", "int", "stop-cont", "hang", "segfault", "writer-error",
                                            "drive", "mix")), default=None,
              help="What to inject: a signal (kill, term, int; SIGKILL takes every process the run started), a "
                   "freeze (stop-cont: SIGSTOP then SIGCONT), a hang of the training thread (the target needs a "
                   "short --hang-timeout), a segfault, a checkpoint write failing with EIO, a Drive API call "
                   "failing (drive: 503, 429, a stalled answer, a dropped connection; needs --run-dir "
                   "gdrive://.../{run_dir}); mix draws each time (drive only with a Drive run dir). Default: --signal.")
@click.option("--signal", "signal_mode", type=click.Choice(("KILL", "TERM", "INT", "mix")), default="KILL",
              show_default=True, help="Signal to kill with when --fault is not given; mix picks one at random "
                                      "each time.")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Seed of the kill timing (printed).")
@click.option("--every", type=Duration(), default="5s", show_default=True,
              help="Mean training time of a session before its kill, counted from its first step.")
@click.option("--mid-save-every", type=click.IntRange(min=0), default=3, show_default=True,
              help="Every Nth kill lands inside a checkpoint write (0: never).")
@click.option("--reference", type=click.Path(file_okay=False, exists=True), default=None,
              help="An uninterrupted run dir to compare with, instead of running one.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Where the scratch run dirs go (default: a new temporary folder, kept).")
@click.option("--warm", is_flag=True,
              help="Restart through a fork server that imported torch (and a Python target) once, so a restart "
                   "costs what the engine spends (restore, data load) and not the ~2 s of interpreter start a "
                   "fresh VM pays. Not for --target command.")
@click.option("--parallel-reference", is_flag=True,
              help="Run the uninterrupted reference at the same time (halves a long soak; give each run "
                   "its own cores, e.g. OMP_NUM_THREADS=1 on two).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--break-rng-restore", is_flag=True, hidden=True,
              help="Skip restoring RNG states on resume (proves the harness detects divergence).")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def chaos(target: str, kills: int, fault: str | None, signal_mode: str, seed: int | None, every: str,
          mid_save_every: int, reference: str | None, workdir: str | None, warm: bool, parallel_reference: bool,
          as_json: bool, break_rng_restore: bool, args: tuple[str, ...]) -> None:
    """Inject faults into a training run (`resumable-train ARGS` unless --target says otherwise) at random
    moments (kills by default), restart it until it completes, and compare the result with an uninterrupted
    run: the newest valid checkpoint's fingerprint and the metrics.jsonl records. Exit 0 if IDENTICAL, 1 if
    DIVERGED. With kills in the mix, every --mid-save-every-th lands inside a checkpoint write, and the second
    lands on the very first step after a resume.

    \b
    Examples:
      resumable chaos --kills 5 -- --data-dir ../shared/data/mnist-mini --max-steps 300
      resumable chaos --target scripts/own_model_example.py:main --warm -- --run-dir {run_dir} --max-steps 40
      resumable chaos --target command -- torchrun --nproc-per-node 2 train.py --run-dir {run_dir}
      resumable chaos --fault drive --kills 8 -- --run-dir gdrive://root/chaos-test/{run_dir} --max-steps 300
    """
    from ..faults import Faults
    from ..tools.chaos import Chaos, Target, format_report, report_json

    try:
        chosen = Target.parse(target, args)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    if warm and chosen.kind == "command":
        raise click.UsageError("--warm forks a Python process that imported torch once; a command target starts "
                               "afresh each time. For warm restarts of a Python script, name it: --target "
                               "FILE.py (or FILE.py:FUNCTION, MODULE:FUNCTION)")
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="resumable-chaos-"))
    echo = (lambda message: click.echo(message, err=True)) if as_json else click.echo
    what = f"{kills} fault(s): {fault}" if fault else f"{kills} kill(s) with SIG{signal_mode}"
    echo(f"chaos: {target}, seed {seed}, {what}, {'warm' if warm else 'cold'} "
         f"restarts, scratch dirs in {work}")
    mode = fault or {"KILL": "kill", "TERM": "term", "INT": "int", "mix": "signals"}[signal_mode]
    try:
        runner = Chaos(chosen, work, kills, mode, seed, parse_duration(every), mid_save_every,
                       Faults(skip_rng_restore=True).to_env() if break_rng_restore else None, echo=echo,
                       warm=warm, parallel_reference=parallel_reference)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    try:
        report = runner.run(Path(reference) if reference else None)
    except RuntimeError as e:
        fail(str(e))
    click.echo(report_json(report) if as_json else format_report(report))
    sys.exit(0 if report.verdict == "IDENTICAL" else 1)


@main.command("drive-login")
@click.option("--client-secrets", type=click.Path(exists=True, dir_okay=False), required=True,
              help="OAuth client secrets JSON of a 'Desktop app' client from the Google Cloud console.")
@click.option("--token", type=click.Path(dir_okay=False), default=None,
              help="Where to save the token (default ~/.config/resumable/drive-token.json, mode 0600).")
def drive_login(client_secrets: str, token: str | None) -> None:
    """Authorise resumable to use your Google Drive from a shell (command-line OAuth flow)."""
    from ..storage.auth import DEFAULT_TOKEN
    from ..storage.auth import drive_login as login

    path = login(client_secrets, Path(token) if token else DEFAULT_TOKEN)
    click.echo(f"saved a Drive token to {path} (readable by you only); gdrive:// run dirs will use it")


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--drive-credentials", type=click.Path(dir_okay=False), default=None,
              help="Credentials for gdrive:// run dirs (see resumable-train --help).")
@click.option("--deep", is_flag=True,
              help="For a gdrive:// run dir: download every file and check its sha256 (a local run dir is "
                   "always hashed).")
def verify(run_dir: str, drive_credentials: str | None, deep: bool) -> None:
    """Re-hash every checkpoint of RUN_DIR; exit 1 if the newest committed one is not valid.

    A step folder without a manifest (a save killed half-way) is not a checkpoint: it is listed as an unfinished
    save and not judged, since a start ignores it and removes it. A gdrive:// run dir is checked on Drive without
    downloading the payload (sizes, and md5 where the manifest records it), or hashed with --deep."""
    from ..checkpoint import CheckpointManager, checkpoints_dir
    from ..storage.gdrive import is_drive_url, misspelt_drive_url

    if is_drive_url(run_dir) or misspelt_drive_url(run_dir):  # a misspelt one is refused there, with the fix
        _verify_drive(run_dir, drive_credentials, deep)
        return
    infos = CheckpointManager(checkpoints_dir(run_dir)).inspect(deep=True)
    for info in infos:
        if not info.committed:
            click.echo(f"step {info.step}: unfinished save (no manifest; ignored, removed at the next start)")
        elif info.valid:
            click.echo(f"step {info.step}: ok" + (f" ({info.note})" if info.note else ""))
        else:
            click.echo(f"step {info.step}: INVALID: {info.reason}")
    committed = [info for info in infos if info.committed]
    if not committed:
        unfinished = f" (only {len(infos)} unfinished save(s))" if infos else ""
        fail(f"no checkpoints in {checkpoints_dir(run_dir)}{unfinished}")
    if not committed[-1].valid:
        fallback = next((i.step for i in reversed(committed) if i.valid), None)
        then = (f"the next start resumes from step {fallback}, the newest valid one" if fallback is not None else
                "no checkpoint is valid: start over with --fresh --overwrite, or use another --run-dir")
        click.echo(f"newest checkpoint (step {committed[-1].step}) is not valid; {then}", err=True)
        sys.exit(1)


def _verify_drive(run_dir: str, credentials: str | None, deep: bool) -> None:
    """verify for a gdrive:// run dir: what a fresh machine would restore from, checked where it is."""
    from ..storage import StorageError, open_run_location
    from ..storage.durable import INCOMPLETE, describe_remote
    from ..storage.placement import HOLDER

    try:
        remote = open_run_location(run_dir, credentials=credentials).remote
        assert remote is not None
        with tempfile.TemporaryDirectory() as scratch:
            entries = describe_remote(remote, Path(scratch), deep=deep)
    except (StorageError, ValueError) as e:  # ValueError: a malformed gdrive:// URL, named with the fix
        fail(str(e))
    committed = []
    for entry in entries:
        if entry["reason"] == INCOMPLETE:  # no manifest: never a checkpoint, ignored by a restore
            click.echo(f"step {entry['step']}: unfinished upload (no manifest; ignored)")
        elif entry["reason"] == HOLDER:
            click.echo(f"step {entry['step']}: pruned: {HOLDER}")
        else:
            committed.append(entry)
            if entry["valid"]:
                more = "" if entry["checked"] != "sizes" else "; its manifest records no md5: --deep hashes each file"
                click.echo(f"step {entry['step']}: ok ({entry['checked']} checked{more})")
            else:
                click.echo(f"step {entry['step']}: INVALID: {entry['reason']}")
    if not committed:
        fail(f"no checkpoints on {remote.description}")
    if not committed[-1]["valid"]:
        fallback = next((e["step"] for e in reversed(committed) if e["valid"]), None)
        then = (f"the next start resumes from step {fallback}, the newest valid one" if fallback is not None else
                "no checkpoint is valid: start over with --fresh --overwrite, or use another --run-dir")
        click.echo(f"newest checkpoint (step {committed[-1]['step']}) is not valid; {then}", err=True)
        sys.exit(1)


@main.command("run", context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
@click.argument("target", metavar="SCRIPT|MODULE:FUNCTION")
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[-- ARGS...]")
@click.option("--max-restarts", type=click.IntRange(min=0), default=3, show_default=True,
              help="Restarts after a crash or a hang (exit 76) before giving up with the script's last exit code.")
@click.option("--backoff", type=Duration(), default="5s", show_default=True,
              help="Wait before the first restart; it doubles with each restart, up to --backoff-max.")
@click.option("--backoff-max", type=Duration(), default="5m", show_default=True,
              help="The longest wait before a restart.")
@click.option("--time-limit", type=Duration(), default=None,
              help="Budget of the whole supervised session (e.g. 11h): each start of the script gets what is left, "
                   "through RESUMABLE_DEADLINE, and stops cleanly (exit 75) before it ends. Default: none (the "
                   "script's own limit; in Colab the VM's lifetime).")
@click.option("--min-session", type=Duration(), default="2m", show_default=True,
              help="With --time-limit: no restart starts with less than this left after its backoff.")
def run_command(target: str, args: tuple[str, ...], max_restarts: int, backoff: str, backoff_max: str,
                time_limit: str | None, min_session: str) -> None:
    """Run a resumable script and restart it after a crash or a hang.

    SCRIPT is a training script that uses resumable.Run and ends with sys.exit(run.exit_code); MODULE:FUNCTION
    (or FILE.py:FUNCTION) is imported and called without arguments. Everything after SCRIPT (after `--`) goes to
    it as its arguments. Its output is not captured. Stops on exit 0 (done), 75 (stopped early, state committed),
    74 (not durable on Drive: run again to upload), 77 (crash loop) and 2 (bad input); restarts after 76 (hang),
    any other code or death by a signal, from the newest committed checkpoint. SIGINT, SIGTERM and SIGHUP are
    passed to the script (it saves and exits 75) and end the supervision. Exits with the script's last code
    (128+N for death by signal N).

    \b
      resumable run train.py -- --lr 3e-4
      resumable run --time-limit 11h --max-restarts 5 mypkg.train:main -- --epochs 20
    """
    from ..tools.supervise import Policy, Supervisor, child_command

    if args[:1] == ("--",):
        args = args[1:]
    try:
        command = child_command(target, args)
    except ValueError as e:
        fail(str(e))
    policy = Policy(max_restarts=max_restarts, backoff_s=parse_duration(backoff),
                    backoff_max_s=parse_duration(backoff_max),
                    time_limit_s=None if time_limit is None else parse_duration(time_limit),
                    min_session_s=parse_duration(min_session))
    try:
        supervisor = Supervisor(command, policy, echo=echo_err)
    except ResumableError as e:  # an inherited RESUMABLE_DEADLINE that is not a time
        fail(str(e))
    exit_with(supervisor.run())


def _register_commands() -> None:
    # Imported when used: `resumable-train` and the light commands start without importing torch.
    main.lazy_commands.update({"export": "resumable.tools.export:export_command",
                               "torchrun": "resumable.tools.launch:launch_command",
                               "plot": "resumable.tools.plot:plot_command"})


_register_commands()
