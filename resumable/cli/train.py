"""``resumable-train``: its options, checked before anything heavy is imported, then the MNIST training."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from ..config import AMP_MODES, DEVICES, LR_SCHEDULES, SEED_MAX, TrainConfig, path_problem
from .exits import echo_err, exit_now, exit_with
from .params import Duration, PositiveFinite, Size

# click parameter name -> TrainConfig field, for options that map one to one.
_CONFIG_OPTIONS = ("run_dir", "data_dir", "epochs", "max_steps", "batch_size", "lr", "seed", "device", "cpu_fallback",
                   "lr_schedule", "amp", "checkpoint_steps", "checkpoint_every", "mtbf", "time_limit",
                   "sync_checkpoints", "on_save_error",
                   "keep", "keep_best", "log_every", "tensorboard", "wandb", "mlflow", "trackio", "download",
                   "progress", "cache_dir",
                   "drive_credentials", "drive_flush_timeout", "store_frozen", "shard_size", "staging_memory",
                   "hang_timeout", "quiet")



_PATH_OPTIONS = (("run_dir", "--run-dir"), ("data_dir", "--data-dir"), ("cache_dir", "--cache-dir"))


def _writable_dir(path: str) -> bool:
    """True if ``path`` exists as a writable directory or could be created."""
    target = Path(path).absolute()
    while not target.exists():
        if target.parent == target:
            return False
        target = target.parent
    return target.is_dir() and os.access(target, os.W_OK | os.X_OK)


class _Program(click.Command):
    """A command that ends with :func:`exits.exit_now` when it is run as a program (called, as its console script and
    ``resumable chaos``'s fork server do); ``CliRunner`` and other in-process callers use ``main`` and get the
    usual ``SystemExit``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.main(*args, **kwargs)
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                exit_now(e.code or 0)
            raise


@click.command(cls=_Program, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--run-dir", default=TrainConfig.run_dir, show_default=True,
              help="Where checkpoints and metrics.jsonl live: a path (local or a mounted Drive folder) or "
              "gdrive://<folder-id or root>/<path>. Re-running with the same --run-dir resumes.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=TrainConfig.data_dir, show_default=True,
              help="Folder holding MNIST/raw/ (torchvision layout); downloaded there when missing.")
@click.option("--epochs", type=click.IntRange(min=1), default=TrainConfig.epochs, show_default=True,
              help="Passes over the training set; a run resumed with more epochs trains on to the new end.")
@click.option("--max-steps", type=click.IntRange(min=0), default=None,
              help="Stop after this many optimizer steps in total (across resumes).")
@click.option("--batch-size", type=click.IntRange(min=1), default=TrainConfig.batch_size, show_default=True,
              help="Samples a step, per process under torchrun; must equal the checkpoint's to resume.")
@click.option("--lr", type=PositiveFinite(), default=TrainConfig.lr, show_default=True,
              help="Adam's learning rate (the peak of --lr-schedule onecycle); must equal the checkpoint's to resume.")
@click.option("--seed", type=click.IntRange(min=0, max=SEED_MAX), default=TrainConfig.seed, show_default=True,
              help="Seeds the weights, the epoch orders and every random stream; must equal the checkpoint's.")
@click.option("--device", type=click.Choice(DEVICES), default=TrainConfig.device, show_default=True,
              help="auto: the GPU when there is one (one a process under torchrun), else the CPU.")
@click.option("--cpu-fallback/--no-cpu-fallback", default=TrainConfig.cpu_fallback, show_default=True,
              help="A GPU that fails its preflight (one real CUDA operation, its architecture against this torch's: "
                   "a Kaggle P100): train on the CPU with a warning instead of exiting 2 with the fix.")
@click.option("--lr-schedule", type=click.Choice(LR_SCHEDULES), default=TrainConfig.lr_schedule,
              show_default=True, help="step: x0.7 each epoch; onecycle: OneCycleLR over the whole run.")
@click.option("--amp", type=click.Choice(AMP_MODES), default=TrainConfig.amp, show_default=True,
              help="Mixed precision: bf16, or fp16 with a GradScaler; auto: bf16 on GPUs with native bf16 (sm_80+), "
              "fp16 on older GPUs, none on CPU (a resumed run keeps its own unless it is bf16 on an older GPU).")
@click.option("--checkpoint-steps", type=click.IntRange(min=1), default=None,
              help="Also checkpoint every N optimizer steps (always at each epoch end and at the end).")
@click.option("--checkpoint-every", type=Duration(allow=("auto",)), default=TrainConfig.checkpoint_every,
              show_default=True, help="Checkpoint every DURATION of wall clock (90s, 5m, 1h30m), or 'auto': "
              "sqrt(2 x save cost x --mtbf), within 30s..30m.")
@click.option("--mtbf", type=Duration(), default=TrainConfig.mtbf, show_default=True,
              help="Expected time between failures, for --checkpoint-every auto.")
@click.option("--time-limit", type=Duration(), default=None,
              help="Session budget: commit a checkpoint and exit 75 before this much time has passed "
              "(counted from process start). In Colab it defaults to the time left before the 12 h VM limit.")
@click.option("--sync-checkpoints", is_flag=True, default=False,
              help="Write checkpoints on the training thread instead of in the background.")
@click.option("--on-save-error", type=click.Choice(("warn", "stop")), default=TrainConfig.on_save_error,
              show_default=True, help="When a checkpoint cannot be written (disk full, I/O error): warn loudly "
              "and retry at the next trigger, or stop with exit 75.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Local cache for Drive run dirs (default: ~/.cache/resumable).")
@click.option("--drive-credentials", type=click.Path(dir_okay=False), default=None,
              help="Service-account JSON key or a token from `resumable drive-login` (for gdrive:// run dirs).")
@click.option("--drive-flush-timeout", type=Duration(), default=TrainConfig.drive_flush_timeout,
              show_default=True, help="At exit, wait at most this long for checkpoints to reach Drive.")
@click.option("--keep", type=click.IntRange(min=1), default=TrainConfig.keep, show_default=True,
              help="Number of newest checkpoints to keep.")
@click.option("--keep-best/--no-keep-best", default=TrainConfig.keep_best, show_default=True,
              help="Also keep the checkpoint with the best test accuracy.")
@click.option("--log-every", type=click.IntRange(min=1), default=TrainConfig.log_every, show_default=True,
              help="Write a training record to metrics.jsonl every N steps.")
@click.option("--store-frozen", is_flag=True, default=False,
              help="Store frozen tensors too (default: tensors without grad that no optimizer owns and that never "
                   "change are recorded by their sha256 and checked on resume, not written).")
@click.option("--shard-size", type=Size(), default=TrainConfig.shard_size, show_default=True,
              help="Most tensor bytes per safetensors file of a checkpoint (e.g. 256MB, 1GiB).")
@click.option("--staging-memory", type=Size(), default=None,
              help="Host memory that asynchronous saves copy the state into (e.g. 4GB; 0: none). Training waits "
                   "while the part that does not fit is written. Default: half of the free host memory.")
@click.option("--hang-timeout", type=Duration(allow=("auto", "off")), default=TrainConfig.hang_timeout,
              show_default=True, help="Exit 76 with every thread's stack in RUN_DIR/hang-*.txt when no step completes "
              "for this long (evaluation and saves excepted; a session's first step gets at least 15m); 'auto': "
              "max(10 x p99 step time, 5m); 'off'.")
@click.option("--resume-from", type=click.IntRange(min=0), default=None, metavar="STEP",
              help="Resume from the checkpoint of STEP instead of the newest; the newer ones are moved to "
              "RUN_DIR/set-aside/.")
@click.option("--ignore-crash-loop", is_flag=True, default=False,
              help="Start even when the last 3 sessions all failed from the same step (otherwise exit 77).")
@click.option("--tensorboard", is_flag=True, default=TrainConfig.tensorboard,
              help="Also write TensorBoard events to RUN_DIR/tensorboard (pip install 'resumable[tensorboard]').")
@click.option("--wandb", metavar="PROJECT", default=None,
              help="Also log the metrics to Weights & Biases project PROJECT: one W&B run across every session "
              "(pip install 'resumable[wandb]'; WANDB_MODE=offline works).")
@click.option("--mlflow", metavar="EXPERIMENT", default=None,
              help="Also log the metrics to MLflow experiment EXPERIMENT: one MLflow run across every session, each "
              "step once (pip install 'resumable[mlflow]'; store: MLFLOW_TRACKING_URI, else the file store "
              "RUN_DIR/mlruns).")
@click.option("--trackio", metavar="PROJECT", default=None,
              help="Also log the metrics to trackio project PROJECT: one trackio run across every session, each "
              "step once (pip install 'resumable[trackio]'; store: TRACKIO_DIR, else RUN_DIR/trackio).")
@click.option("--download/--no-download", default=TrainConfig.download, show_default=True,
              help="Download MNIST when the files are missing.")
@click.option("--progress/--no-progress", default=TrainConfig.progress, show_default=True,
              help="Show tqdm progress bars.")
@click.option("--quiet", is_flag=True, default=TrainConfig.quiet,
              help="Print only warnings, errors and the final summary (no progress bars, no per-epoch lines).")
@click.option("--resume", "mode", flag_value="resume", help="Require a checkpoint to resume from.")
@click.option("--fresh", "mode", flag_value="fresh", help="Start over (refused if checkpoints exist, "
              "unless --overwrite).")
@click.option("--overwrite", is_flag=True, help="With --fresh: delete existing checkpoints and metrics.")
@click.pass_context
def train_command(ctx: click.Context, mode: str | None, overwrite: bool, resume_from: int | None,
                  ignore_crash_loop: bool, **options: Any) -> None:
    """Train the MNIST CNN of the classic Colab guide, resumably.

    Kill it at any moment and run the same command again: it continues from the newest valid
    checkpoint and ends with the same weights as a run that was never interrupted.
    """
    from ..engine.loop.preemption import install_startup_handlers

    install_startup_handlers()  # first: a SIGTERM or Ctrl-C while torch imports is a clean stop, not a traceback
    if options["quiet"]:
        from .. import log

        log.set_quiet(True)  # the whole command: the task's own lines too
    explicit = {name: options[name] for name in _CONFIG_OPTIONS
                if ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT}
    explicit["run_dir"] = options["run_dir"]
    if overwrite and mode != "fresh":
        raise click.UsageError("--overwrite only makes sense with --fresh")
    if resume_from is not None and mode == "fresh":
        raise click.UsageError("--resume-from continues from a checkpoint and --fresh starts over: give one of them")
    for name, flag in _PATH_OPTIONS:
        value = options[name]
        remote = name == "run_dir" and value.startswith("gdrive://")  # a Drive URL is checked where it is parsed
        problem = None if value is None or remote else path_problem(value)
        if problem:
            shown = repr(value) if len(value) <= 80 else f"{value[:60]!r}... ({len(value)} characters)"
            raise click.BadParameter(f"{shown} {problem}", param_hint=flag)
    if not options["run_dir"].startswith("gdrive://") and not _writable_dir(options["run_dir"]):
        raise click.BadParameter(f"{options['run_dir']!r} is not a writable directory (or cannot be created)",
                                 param_hint="--run-dir")
    try:
        TrainConfig(**{**explicit})  # validate before touching anything
    except ValueError as e:
        raise click.UsageError(str(e)) from e

    from ..errors import EXIT_INTERRUPTED, ResumableError, StopNow

    try:
        from ..tasks.train_mnist import train  # heavy imports (torch) after cheap validation

        code = train(explicit, mode=mode or "auto", overwrite=overwrite, resume_from=resume_from,
                     ignore_crash_loop=ignore_crash_loop).exit_code
    except ResumableError as e:  # the one place errors become exit codes (2: bad input, 75: run again, 77: loop)
        echo_err(f"error: {e}")
        exit_with(e.exit_code)
    except KeyboardInterrupt:
        echo_err("interrupted; the newest committed checkpoint is intact — run the same command to continue")
        exit_with(EXIT_INTERRUPTED)
    except StopNow as e:  # a second SIGTERM while a checkpoint save was running
        echo_err(f"error: {e}")
        exit_with(e.exit_code)
    exit_with(code)
