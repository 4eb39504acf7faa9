"""Weights & Biases: the records of ``metrics.jsonl`` in ONE W&B run across every session (extra ``wandb``).

The W&B run id is recorded in each checkpoint's manifest (``wandb_run_id``, next to the config; not a
computation field, so it never blocks a resume), and every session that resumes a checkpoint continues that
run with ``wandb.init(id=..., resume="allow")``. Each record is logged at its ``step``.

W&B cannot rewind a run's history, and what it holds after a kill is not what was handed to ``wandb.log``:
wandb-core buffers records (offline: in its transaction log, written in 32 KiB blocks and every 15 s) and a
SIGKILL loses the buffer. So the last step W&B has is read back from W&B itself at the start of each session,
never from a marker of ours (which would claim steps W&B lost): online, the server's ``starting_step`` of the
resumed run; offline, the highest step in the run's earlier offline files (reporting/wandb_files.py). Then:
records with a step up to that one are not sent again (said once), and the records between it and the
resumed checkpoint — durable in ``metrics.jsonl``, which is fsynced before each checkpoint commits — are sent
from that file, so W&B ends with the same records as ``metrics.jsonl``. ``wandb.init(resume_from=...)``
(rewind) is not used: offline it only records a branch point that the server may or may not honour at sync,
and online it is a W&B preview open on request.

Skipping the steps W&B has is right only when this session trains them again to the same values: a resume from
an older checkpoint (a fallback, ``--resume-from``) re-trains the steps between it and W&B's last one, and an
inexact resume (another device, changed code or data) gives them other values. The reporter cannot see why, so it
checks what matters: W&B's rows of those steps are read back (offline: its files; online: the public API) and
compared, timing fields aside, with this session's records of the same steps as they come. Equal: nothing is
sent, W&B already holds them. Different (or a step one side lacks): W&B cannot take a step twice, so one warning
names the steps that keep the earlier session's values in W&B (``metrics.jsonl`` has this session's) and how to
replace them (a W&B rewind or fork at the resumed step); the records after W&B's last step are sent as usual.

A W&B failure (no network, a dead service) is raised as OSError, which the Reporters fan-out turns into one
warning; training and checkpoints go on.
"""

from __future__ import annotations

import os
import secrets
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import log
from .metrics import read_records
from .reporters import Reporter
from .tracking import guard, numbers, require, same, stored_name, values
from .wandb_files import offline_history

WANDB_ID = "wandb_run_id"  # the manifest key


def require_wandb() -> None:
    """Fail at once (exit 2 from the CLI) when W&B is asked for and not installed."""
    require("wandb", "wandb", "W&B tracking (--wandb / tracker='wandb')")


def stored_id(manifest: Mapping[str, Any] | None) -> str | None:
    """The W&B run id a checkpoint's manifest recorded, or None (absent, or not a plausible id)."""
    return stored_name(manifest, WANDB_ID, "W&B")


def choose_id(manifest: Mapping[str, Any] | None, tracker: Any) -> str | None:
    """The W&B run id this session records: the checkpoint's (a new one for a new run); a W&B run object's own
    id; the checkpoint's when tracking is off this session, so a later session continues the same run."""
    stored = stored_id(manifest)
    if tracker is None or tracker == "wandb":
        if tracker is None or stored is not None:
            return stored
        return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    given = str(tracker.id)
    if stored is not None and stored != given:
        log.warning(f"the W&B run passed in ({given}) is not the one the checkpoint recorded ({stored}); its history "
                    f"continues in {given}. To continue {stored}: wandb.init(id={stored!r}, resume='allow')")
    return given


def _guard(what: str):  # noqa: ANN202 - a context manager
    return guard("W&B", what)


class WandbReporter(Reporter):
    """Logs every training and evaluation record to W&B run ``run_id`` (see the module docstring).

    ``run``: a W&B run the user started (it is logged to and not finished here); None: ``wandb.init`` with
    ``project`` (None: W&B's default, e.g. ``WANDB_PROJECT``), files under ``WANDB_DIR`` or else ``run_dir``."""

    def __init__(self, run_id: str, project: str | None, run_dir: Path, metrics: Path,
                 config: Mapping[str, Any] | None = None, run: Any = None) -> None:
        self.run_id, self.project, self.run_dir, self.metrics = run_id, project, Path(run_dir), Path(metrics)
        self.config = dict(config or {})
        self._given = run
        self._run: Any = None
        self.held: int | None = None  # the last step W&B already has; records up to it are not sent
        self._start = 0  # the step this session resumed from: it trains the steps after it again
        self._checking = False  # whether those steps, up to held, are compared with what W&B has
        self._theirs: dict[int, dict[str, Any]] = {}  # W&B's rows of the steps after _start up to held...
        self._mine: dict[int, dict[str, Any]] = {}  # ...and this session's, compared step by step

    def session_start(self, step: int, total_steps: int | None, resumed_from: int | None) -> None:
        with _guard("init"):
            if self._given is not None:
                self._run = self._given
            else:
                import wandb

                self._run = wandb.init(project=self.project, id=self.run_id, resume="allow",
                                       dir=os.environ.get("WANDB_DIR") or str(self.run_dir), config=self.config)
            self._start = step
            self.held, rows = self._held(step)
        self._checking = self.held is not None and self.held > step and rows is not None
        self._theirs = rows or {}
        if self.held is not None:
            again = f"; steps {step + 1} to {self.held} are trained again and checked against W&B's" \
                if self._checking else ""
            log.info(f"W&B already has steps up to {self.held}; records up to {self.held} are not sent again{again}")
        # The records between what W&B has and the resumed checkpoint (a killed session's buffer) come from
        # metrics.jsonl, which holds them durably; nothing is logged beyond `step` yet.
        for record in read_records(self.metrics):
            if record["step"] <= step:
                self._send(record)

    def _held(self, after: int) -> tuple[int | None, dict[int, dict[str, Any]] | None]:
        """W&B's last step, and its rows of the steps after ``after`` up to that one (what this session re-trains);
        None for the rows when they could not be read."""
        settings = self._run.settings
        mode = getattr(settings, "mode", "online")
        if mode == "disabled":
            return None, {}
        if mode in ("offline", "dryrun"):
            return offline_history(Path(settings.wandb_dir), self._run.id, after, exclude=Path(settings.sync_dir))
        starting = getattr(self._run, "starting_step", 0) or 0  # the server's last step + 1 on a resumed run
        held = starting - 1 if starting > 0 else None
        if held is None or held <= after:
            return held, {}
        try:
            import wandb

            rows = wandb.Api().run(self._run.path).scan_history(min_step=after + 1, max_step=held + 1,
                                                                use_cache=False)
            return held, {row["_step"]: row for row in rows}
        except Exception as e:  # noqa: BLE001 - no network, no API key: skipped unchecked, and said
            log.warning(f"W&B already has steps {after + 1} to {held}, which this session trains again, and they could "
                        f"not be read back to compare ({type(e).__name__}: {e}): they are not sent again, and W&B "
                        f"keeps its values for them whether or not this session reproduces them")
            return held, None

    def _send(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if self._run is None or not isinstance(step, int):
            return
        row = numbers(record)
        self._compare(before=step)
        if self.held is not None and step <= self.held:
            if self._checking and step > self._start:  # trained again by this session: compared once complete
                self._mine.setdefault(step, {}).update(row)
            return  # W&B has this step and cannot take it twice
        with _guard("log"):
            self._run.log(row, step=step)  # two records of one step (train, eval) become one W&B row

    def _compare(self, before: int) -> None:
        """Compare W&B's rows with this session's for the re-trained steps before ``before`` (complete, since the
        records come in step order); the first difference is warned about, and comparing stops there."""
        for step in sorted(s for s in {*self._theirs, *self._mine} if s < before):
            theirs, mine = values(self._theirs.pop(step, None)), values(self._mine.pop(step, None))
            if not same(theirs, mine):
                self._checking = False
                self._theirs.clear()
                self._mine.clear()
                self._diverged(step, theirs, mine)
                return

    def _diverged(self, step: int, theirs: dict[str, Any] | None, mine: dict[str, Any] | None) -> None:
        if mine is None:
            detail = "W&B has a record there, this session none"
        elif theirs is None:
            detail = "this session has a record there, W&B none"
        else:
            key = next(k for k in sorted({*theirs, *mine}) if not same(theirs.get(k), mine.get(k)))
            detail = f"{key} {mine.get(key)} here, {theirs.get(key)} in W&B"
        run, start = self._run.id, self._start
        log.warning(f"W&B run {run} already has steps {step} to {self.held}, and this session trains them to other "
                    f"values (step {step}: {detail}): the resume from step {start} did not reproduce the session W&B "
                    f"recorded (an inexact resume: another device, thread count, code, data or settings). W&B cannot "
                    f"take a step twice, so it keeps the earlier values of steps {step} to {self.held}; metrics.jsonl "
                    f"has this session's, and steps after {self.held} are sent as usual. To replace them in W&B, "
                    f"rewind it (wandb.init(id={run!r}, resume_from='{run}?_step={start}'), a W&B preview) or fork "
                    f"it (wandb.init(fork_from='{run}?_step={start}'), a new W&B run)")

    def step(self, step: int, record: dict[str, Any] | None, postfix: dict[str, str] | None) -> None:
        if record is not None:
            self._send(record)

    def summary(self, record: dict[str, Any], line: str) -> None:
        self._send(record)

    def session_end(self, step: int, ended: str) -> None:
        if self._run is not None:
            # the steps before the last are complete; the last one's records may not be (an error in evaluate)
            self._compare(before=step)
        run, self._run = self._run, None
        if run is not None and self._given is None:
            with _guard("finish"):
                run.finish()  # makes this session's records durable (offline: the whole transaction log)
