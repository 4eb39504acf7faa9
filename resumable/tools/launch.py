"""``resumable torchrun [torchrun args...]``: torchrun, with exit code 75 when training stopped on purpose.

Under plain ``torchrun`` a worker that exits 75 ("stopped early, state committed, run again") counts as a
failure: with ``--max-restarts N`` the agent restarts the group, which trains on past the user's stop with a
fresh budget, and torchrun finally exits 1. So a worker that stops on purpose under torchelastic records the
stop (engine/loop/preemption.py) and exits 0, which ends the group. This launcher runs torchrun's own code in this
process (``torch.distributed.run``), points the workers at a marker file of its own, and after the group ends
maps the outcome: 75 when the workers recorded a planned stop, 0 when training finished, 1 when the group
failed (as torchrun does).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import click

from ..engine.loop.torchrun_stop import STOP_MARKER_ENV, read_planned_stop
from ..errors import EXIT_RESUME

EXIT_FAILED = 1  # torchrun's exit code when the worker group failed


def launch(torchrun_args: list[str]) -> int:
    """Run ``torchrun torchrun_args`` in this process and return the exit code for the user."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(torchrun_args)
    scratch = Path(tempfile.mkdtemp(prefix="resumable-torchrun-"))
    marker = scratch / "stopped.json"  # this launch's own: no older run can have left one here
    previous = os.environ.get(STOP_MARKER_ENV)
    os.environ[STOP_MARKER_ENV] = str(marker)  # the workers inherit the agent's environment
    failure: str | None = None  # the group failed (a worker exited non-zero and no restart was left)
    signalled: str | None = None  # the agent itself was signalled; it passed the signal on to the workers
    try:
        record(run)(args)
    except ChildFailedError as e:
        failure = e.format_msg()
    except SignalException as e:
        signalled = e.sigval.name
    finally:
        if previous is None:
            os.environ.pop(STOP_MARKER_ENV, None)
        else:
            os.environ[STOP_MARKER_ENV] = previous
        stop = read_planned_stop(marker)
        shutil.rmtree(scratch, ignore_errors=True)
    if stop is not None:
        if failure is not None:  # the state is committed; what failed came after it
            click.echo(f"resumable: warning: a worker failed after the planned stop:\n{failure}", err=True)
        click.echo(f"resumable: stopped early ({stop.reason}) at step {stop.step}, state committed: run the same "
                   f"command again to continue (exit code {EXIT_RESUME})", err=True)
        return EXIT_RESUME
    if signalled is not None:
        click.echo(f"resumable: torchrun was stopped by {signalled} before the workers recorded a stop (exit code "
                   f"{EXIT_FAILED}); the newest committed checkpoint is intact: run the same command to continue",
                   err=True)
        return EXIT_FAILED
    if failure is not None:
        click.echo(failure, err=True)
        return EXIT_FAILED
    return 0


@click.command("torchrun", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                             "help_option_names": ["-h", "--help"]})
@click.argument("torchrun_args", nargs=-1, type=click.UNPROCESSED)
def launch_command(torchrun_args: tuple[str, ...]) -> None:
    """torchrun TORCHRUN_ARGS, exiting 75 when training stopped on purpose (time limit, signal) with its state
    committed, so that a retry loop or a scheduler knows to run it again; 0 when training is complete, 1 when
    the group failed. Every argument goes to torchrun (see `torchrun --help`).

    A stop on purpose ends the worker group: torchrun --max-restarts restarts the group only after a crash.

    \b
    Example:
      resumable torchrun --standalone --nproc-per-node 2 --max-restarts 3 $(which resumable-train) \\
          --device cpu --time-limit 1h
    """
    if not torchrun_args:
        raise click.UsageError("give torchrun's arguments, e.g. resumable torchrun --standalone --nproc-per-node 2 "
                               "$(which resumable-train) --time-limit 1h")
    sys.exit(launch(list(torchrun_args)))
