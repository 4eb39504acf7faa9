"""Bringing a remote run dir's newest durable checkpoint back into the local cache, before resuming (a fresh VM).

The remote is untrusted (anyone may write to a shared Drive folder): its manifest is validated like a local one,
file names from it or from a listing must be plain names, and a download never writes through a link or FIFO
already at its name (checkpoint/paths.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..checkpoint import CheckpointManager, paths
from ..checkpoint import format as fmt
from ..reporting.history import SESSIONS
from ..reporting.metrics import METRICS
from ..reporting.tensorboard import TENSORBOARD_DIR
from . import placement
from .base import RemoteStore, run_of, same_run
from .durable import remote_entries


def _created(manifest: dict | None) -> float:
    value = (manifest or {}).get("created_unix")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _drop_stale_cache(local: CheckpointManager, run_dir: Path, run: str | None, newest: tuple[int, dict],
                      description: str, say: Callable[[str], None]) -> bool:
    """Remove the local checkpoints and logs of runs other than ``run`` (the remote's), unless they are newer
    than the remote's ``newest`` (step, manifest). Returns False when the cache holds the newer run."""
    others = [info for info in local.inspect(deep=False)
              if info.manifest is not None and not same_run(run_of(info.manifest), run)]
    if not others:
        return True
    ids = ", ".join(sorted({str(run_of(info.manifest)) for info in others}))
    if max(_created(info.manifest) for info in others) > _created(newest[1]):
        # A run started here after the remote's (--fresh --overwrite) whose first upload never finished:
        # it is the user's newest work, and the remote's folders are leftovers.
        say(f"warning: the local cache {local.root} holds run {ids} (up to step {others[-1].step}), newer than "
            f"run {run} on {description} (step {newest[0]}); keeping the cache and bringing nothing back")
        return False
    say(f"the local cache {local.root} holds run {ids} up to step {others[-1].step}, but {description} holds "
        f"run {run} (newest step {newest[0]}): removing the stale cache and resuming run {run}")
    for info in others:
        local.delete(info.path)
    # Its logs are that run's too (like --fresh --overwrite): the remote's are brought back with the checkpoint.
    for log in (METRICS, SESSIONS):
        (run_dir / log).unlink(missing_ok=True)
    try:
        paths.remove_entry(run_dir / TENSORBOARD_DIR, say)  # a link: only the link goes, and that is said
    except OSError as e:
        say(f"warning: could not remove the stale {run_dir / TENSORBOARD_DIR} ({e})")
    return True


def _fetch(remote: RemoteStore, folder: str, name: str, directory: Path) -> Path:
    """Download ``name`` of the remote ``folder`` as ``directory/name``, never through a link or FIFO there."""
    return paths.write_replacing(directory, name, lambda tmp: remote.get_file(folder, name, tmp),
                                 f"{remote.description} ({folder or 'the run folder'})")


def restore_newest(remote: RemoteStore, local: CheckpointManager, run_dir: Path,
                   say: Callable[[str], None]) -> int | None:
    """Bring the remote's newest durable checkpoint into the local cache when it is newer than every valid local
    one: payload first, sha256-verified, manifest last, with the run's logs. Returns the step brought back.

    The remote decides which run this is: the run of its most recently created durable checkpoint. Local
    checkpoints of another run are a stale cache (a newer run was started elsewhere with --fresh --overwrite):
    they are removed, and the remote's checkpoint is brought back even if its step is lower.
    """
    local.root.mkdir(parents=True, exist_ok=True)
    entries = remote_entries(remote, local.root)
    found = [(step, folder, manifest) for step, folder, manifest, _ in entries]
    durable = [(step, folder, manifest) for step, folder, manifest in found if manifest is not None]
    if not durable:
        return None
    # By creation time, not step: a folder of an older run left behind (a failed delete) may have a higher step.
    _, _, current = max(durable, key=lambda item: (_created(item[2]), item[0]))
    run = run_of(current)
    ours = [item for item in durable if same_run(run_of(item[2]), run)]
    if not _drop_stale_cache(local, run_dir, run, (ours[-1][0], ours[-1][2]), remote.description, say):
        return None
    latest_local, _ = local.latest_valid()
    floor = latest_local.step if latest_local else -1
    for step, folder, manifest, reason in entries:
        if manifest is None and step > floor and reason != placement.HOLDER:
            say(f"warning: skipping remote {folder} on {remote.description}: {reason}")
    for step, folder, manifest in reversed(ours):
        if step <= floor:
            break
        target = paths.real_dir(local.root / folder, say)  # a link there: removed, never written through
        (target / fmt.MANIFEST).unlink(missing_ok=True)
        for name, entry in manifest["files"].items():  # plain names: check_remote refused the manifest otherwise
            _fetch(remote, placement.folder_of(entry, folder), name, target)
        try:
            fmt.verify_files(target, manifest, deep=True)
        except fmt.InvalidCheckpoint as e:
            say(f"warning: remote {folder} on {remote.description} does not verify ({e}); trying an older one")
            continue
        logs = remote.list_files("")
        for log in (METRICS, SESSIONS):
            if log in logs:
                _fetch(remote, "", log, run_dir)
        board = remote.list_files(TENSORBOARD_DIR)
        if board:  # the event files: the resumed session's purge_step drops what followed this checkpoint
            board_dir = paths.real_dir(run_dir / TENSORBOARD_DIR, say)
            for name in board:
                problem = paths.name_problem(name)
                if problem is not None:  # a title like "../../x" in a shared folder: never a path here
                    say(f"warning: skipping the TensorBoard file {name!r} on {remote.description}: not a plain "
                        f"file name ({problem})")
                    continue
                _fetch(remote, TENSORBOARD_DIR, name, board_dir)
        fmt.write_json_atomic(target / fmt.MANIFEST, manifest)  # as on the remote: "folder" keys are only hints here
        say(f"brought checkpoint step {step} back from {remote.description}")
        return step
    return None
