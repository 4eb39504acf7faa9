"""``--resume-from STEP``: continue from an older committed checkpoint instead of the newest.

The newer checkpoints are moved, untouched, out of ``checkpoints/`` into ``RUN_DIR/set-aside/<time>/`` before
training starts (under the run dir's lock): from then on the run is the branch that continues from STEP, so the next
plain start resumes that branch, not the abandoned one, and retention never weighs the abandoned steps against the
new ones. Nothing in ``set-aside/`` is ever read or deleted by resumable: move a step dir back into
``checkpoints/`` to return to it, or delete the folder to free the space. ``metrics.jsonl`` is rolled back to STEP as
on every resume. Not available for Drive run dirs yet (their newer checkpoints would come back from Drive).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ... import log
from ...checkpoint import CheckpointInfo, CheckpointManager
from ...errors import ResumableError

SET_ASIDE = "set-aside"


def choose_step(manager: CheckpointManager, run_dir: str, step: int) -> CheckpointInfo:
    """The committed, valid checkpoint of ``step`` (hashes verified); a usage error listing the valid steps if none."""
    infos = {info.step: info for info in manager.inspect(deep=False) if info.committed}
    valid = [s for s, info in infos.items() if info.valid]
    listed = ", ".join(map(str, valid)) or "none"
    if step not in infos:
        raise ResumableError(f"--resume-from {step}: {run_dir} has no checkpoint of step {step}; valid checkpoint "
                             f"steps: {listed}")
    info = manager.check(step, infos[step].path, deep=True)
    if not info.valid:
        raise ResumableError(f"--resume-from {step}: the checkpoint of step {step} is not valid ({info.reason}); "
                             f"valid checkpoint steps: {', '.join(str(s) for s in valid if s != step) or 'none'}")
    return info


def set_aside_newer(manager: CheckpointManager, run_dir: Path, step: int) -> Path | None:
    """Move the step dirs after ``step`` to ``run_dir/set-aside/<time>/`` (newest first: a start killed half-way
    leaves the oldest of them, and running the same command again finishes the move). Returns the folder."""
    newer = [(s, path) for s, path in manager.step_dirs() if s > step]
    if not newer:
        return None
    base = run_dir / SET_ASIDE / time.strftime("%Y%m%d-%H%M%S")
    target, n = base, 1
    while target.exists():
        n += 1
        target = base.with_name(f"{base.name}-{n}")
    target.mkdir(parents=True)
    for _, path in reversed(newer):
        os.rename(path, target / path.name)  # the entry itself (a link stays a link); same file system
    steps = ", ".join(str(s) for s, _ in newer)
    log.info(f"--resume-from {step}: moved the {len(newer)} newer checkpoint(s) (steps {steps}) to {target}; "
             f"they are kept untouched (move one back into {manager.root} to return to it, or delete "
             f"the folder to free the space)")
    return target
