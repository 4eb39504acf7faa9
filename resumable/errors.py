"""The exceptions resumable raises on purpose, each with the exit code the command line maps it to.

Every message names the cause and the fix. The CLI maps them once (``except ResumableError as e:
sys.exit(e.exit_code)``); nothing else turns an error into an exit code.
"""

from __future__ import annotations

from typing import Any

EXIT_USAGE = 2  # bad input or a run dir that cannot be used as asked; nothing was changed
EXIT_RESUME = 75  # EX_TEMPFAIL: stopped early with the newest committed checkpoint intact; run again
EXIT_NOT_DURABLE = 74  # EX_IOERR: the session ended (done, or stopped as for 75) but its newest committed
# checkpoint is not durable on the remote (Drive) after --drive-flush-timeout: it exists only in the local
# cache, which a VM that goes away takes with it. Run the same command again on this machine to upload it
EXIT_HANG = 76  # no optimizer step for --hang-timeout: stacks dumped to RUN_DIR/hang-*.txt; restart it (the
# newest committed checkpoint is intact)
EXIT_CRASH_LOOP = 77  # refused to start: the last sessions all failed from the same step; fix, --resume-from an
# older checkpoint or --ignore-crash-loop (nothing was changed)
EXIT_INTERRUPTED = 130  # a second Ctrl-C


class ResumableError(Exception):
    """A problem the user can fix by changing how the run is started (exit 2)."""

    exit_code = EXIT_USAGE


class ConfigMismatch(ResumableError):
    def __init__(self, field: str, old: Any, new: Any, run_dir: str, api: bool = False) -> None:
        self.field, self.old, self.new = field, old, new
        advice = ("build the Run with the checkpoint's value, or start a new run dir (or "
                  "Session(resume='never', overwrite=True) to discard it)" if api else
                  "omit the option to reuse the checkpoint's, or start over with --fresh --overwrite, or use "
                  "another --run-dir")
        if api and field == "num_samples":  # new data arrived between sessions
            advice = ("to continue this run with the changed dataset pass session=Session(allow_data_change=True) to "
                      "Run (accepted at an epoch boundary), or start a new run dir")
        super().__init__(f"{field} differs from the checkpoint in {run_dir}: checkpoint {old!r}, now {new!r}. "
                         f"Resuming needs the same value: {advice}.")


class NothingToResume(ResumableError):
    pass


class RunDirInUse(ResumableError):
    pass


class StateNotLoadable(ResumableError):
    """An object's state would commit but could never be loaded back safely (weights_only)."""


class ResumeNotApplied(ResumableError):
    """A checkpoint was loaded but the live state does not hold it (an object did not take its state)."""


class SaveFailed(ResumableError):
    """A checkpoint save failed; the previous committed checkpoint is still the newest valid one (exit 75:
    fix the cause and run again to continue from it)."""

    exit_code = EXIT_RESUME


class SaveStuck(SaveFailed):
    """A save the loop waited for did not finish in time after a stop was asked for (a dead mount or disk): it was
    given up and never commits; the previous committed checkpoint is the newest valid one (exit 75)."""


class CrashLoop(ResumableError):
    """The last sessions all failed without committing past the step this start would resume from (exit 77)."""

    exit_code = EXIT_CRASH_LOOP


class LockLost(ResumableError):
    """Another process took this run dir's lock or lease over; this one stopped without writing more."""

    exit_code = EXIT_RESUME


class StopNow(BaseException):
    """A second stop signal (SIGTERM, SIGHUP, SIGUSR1) while the loop waited for a checkpoint save: stop at once,
    without that save; the newest committed checkpoint stays valid (exit 75). A ``BaseException``, like the
    ``KeyboardInterrupt`` a second Ctrl-C raises, so that no ``except Exception`` in a training step swallows it."""

    exit_code = EXIT_RESUME

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"a second {signal_name} while a checkpoint save was running: stopped at once; the newest "
                         f"committed checkpoint is intact, run again to continue from it")
        self.signal_name = signal_name


class Hung(BaseException):
    """Raised in the training thread of an interactive session (a notebook) when the step watchdog finds it hung
    (engine/loop/watchdog.py): a script exits 76 instead, but a notebook's kernel must survive, so the cell ends with
    this exception. A ``BaseException`` so that no ``except Exception`` around a training step swallows it and trains on
    unwatched."""

    exit_code = EXIT_HANG
