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
from .base import RemoteFile, RemoteStore, run_of, same_run
from .durable import DELETED, INCOMPLETE, md5_of, remote_entries
from .retry import MissingFile, StorageError

DOWNLOADS = 2  # tries per checkpoint: a transfer damaged in transit is fetched again before an older one is tried


def _created(manifest: dict | None) -> float:
    value = (manifest or {}).get("created_unix")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _drop_stale_cache(local: CheckpointManager, run_dir: Path | None, run: str | None, newest: tuple[int, dict],
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
    if run_dir is None:
        return True
    # Its logs are that run's too (like --fresh --overwrite): the remote's are brought back with the checkpoint.
    for log in (METRICS, SESSIONS):
        (run_dir / log).unlink(missing_ok=True)
    try:
        paths.remove_entry(run_dir / TENSORBOARD_DIR, say)  # a link: only the link goes, and that is said
    except OSError as e:
        say(f"warning: could not remove the stale {run_dir / TENSORBOARD_DIR} ({e})")
    return True


class RestoreFailed(StorageError):
    """The remote holds committed checkpoints of this run and none could be brought back: starting fresh would
    train over them, so the session does not start (the message names each step, why, and the fix)."""


def _fetch(remote: RemoteStore, folder: str, name: str, directory: Path) -> Path:
    """Download ``name`` of the remote ``folder`` as ``directory/name``, never through a link or FIFO there."""
    return paths.write_replacing(directory, name, lambda tmp: remote.get_file(folder, name, tmp),
                                 f"{remote.description} ({folder or 'the run folder'})")


def _fetch_log(remote: RemoteStore, folder: str, name: str, directory: Path, listed: RemoteFile,
               say: Callable[[str], None]) -> None:
    """A log file, checked against the md5 the remote lists for it (logs have no sha256 in a manifest): a copy
    damaged in transit is downloaded once more, then kept with a warning (a log never blocks a resume)."""
    for _ in range(DOWNLOADS):
        path = _fetch(remote, folder, name, directory)
        if listed.md5 is None or md5_of(path) == listed.md5:
            return
    say(f"warning: {name} from {remote.description} does not match the md5 Drive lists for it after {DOWNLOADS} "
        f"downloads; keeping it as it is")


def _bring_back(remote: RemoteStore, folder: str, manifest: dict, target: Path,
                say: Callable[[str], None]) -> str | None:
    """Download one checkpoint's payload and verify every sha256; None when it verifies, else why not. A payload
    that does not verify is downloaded again (its bytes may have been damaged in transit, not on the remote)."""
    reason = ""
    for attempt in range(1, DOWNLOADS + 1):
        try:
            for name, entry in manifest["files"].items():  # plain names: check_remote refused the manifest otherwise
                _fetch(remote, placement.folder_of(entry, folder), name, target)
        except MissingFile as e:  # deleted since it was listed: another download cannot bring it back
            return f"a file is missing on the remote ({e})"
        try:
            fmt.verify_files(target, manifest, deep=True)
            return None
        except fmt.InvalidCheckpoint as e:
            reason = str(e)
        if attempt < DOWNLOADS:
            say(f"warning: remote {folder} on {remote.description} does not verify after download ({reason}); "
                f"downloading it again")
    return f"does not verify after {DOWNLOADS} downloads ({reason})"


def restore_newest(remote: RemoteStore, local: CheckpointManager, run_dir: Path | None,
                   say: Callable[[str], None]) -> int | None:
    """Bring the remote's newest durable checkpoint into the local cache when it is newer than every valid local
    one: payload first, sha256-verified, manifest last, with the run's logs (none without ``run_dir``: a Trainer's
    output dir keeps its own). Returns the step brought back.

    The remote decides which run this is: the run of its most recently created durable checkpoint. Local
    checkpoints of another run are a stale cache (a newer run was started elsewhere with --fresh --overwrite):
    they are removed, and the remote's checkpoint is brought back even if its step is lower.

    A checkpoint that does not verify is downloaded again, then the next older one is tried. When the remote holds
    committed checkpoints and neither they nor the local cache give one to resume, raises :class:`RestoreFailed`:
    a fresh start there would train over them (and its pruning delete them). Nothing on the remote is changed.
    """
    local.root.mkdir(parents=True, exist_ok=True)
    entries = remote_entries(remote, local.root, local.layout)
    found = [(step, folder, manifest) for step, folder, manifest, _ in entries]
    durable = [(step, folder, manifest) for step, folder, manifest in found if manifest is not None]
    # Folders whose manifest is there but did not check out (damaged, a file missing): committed once, so they
    # forbid a fresh start as much as a durable one does.
    broken = [(step, f"{folder}: {reason}") for step, folder, manifest, reason in entries
              if manifest is None and reason not in (INCOMPLETE, placement.HOLDER, DELETED)]
    if not durable:
        if broken and local.latest_valid()[0] is None:
            raise _failed(remote, broken)
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
    failed: list[tuple[int, str]] = []
    for step, folder, manifest in reversed(ours):
        if step <= floor:
            break
        target = paths.real_dir(local.root / folder, say)  # a link there: removed, never written through
        (target / fmt.MANIFEST).unlink(missing_ok=True)
        problem = _bring_back(remote, folder, manifest, target, say)
        if problem is not None:
            say(f"warning: remote {folder} on {remote.description} {problem}; trying an older one")
            failed.append((step, f"{folder}: {problem}"))
            local.delete(target)  # no manifest: never a checkpoint; removed so the cache is as it was
            continue
        logs = remote.list_files("") if run_dir is not None else {}
        for log in (METRICS, SESSIONS):
            if log in logs:
                _fetch_log(remote, "", log, run_dir, logs[log], say)
        board = remote.list_files(TENSORBOARD_DIR) if run_dir is not None else {}
        if board:  # the event files: the resumed session's purge_step drops what followed this checkpoint
            board_dir = paths.real_dir(run_dir / TENSORBOARD_DIR, say)
            for name, listed in board.items():
                problem = paths.name_problem(name)
                if problem is not None:  # a title like "../../x" in a shared folder: never a path here
                    say(f"warning: skipping the TensorBoard file {name!r} on {remote.description}: not a plain "
                        f"file name ({problem})")
                    continue
                _fetch_log(remote, TENSORBOARD_DIR, name, board_dir, listed, say)
        fmt.write_json_atomic(target / fmt.MANIFEST, manifest)  # as on the remote: "folder" keys are only hints here
        say(f"brought checkpoint step {step} back from {remote.description}")
        return step
    if failed and floor < 0:
        raise _failed(remote, failed + [item for item in broken if item[0] not in {s for s, _ in failed}])
    if failed:
        say(f"warning: no newer checkpoint could be brought back from {remote.description}; resuming from the "
            f"local step {floor}")
    return None


def _failed(remote: RemoteStore, failures: list[tuple[int, str]]) -> RestoreFailed:
    steps = ", ".join(str(step) for step, _ in sorted(failures, reverse=True))
    reasons = "; ".join(reason for _, reason in sorted(failures, reverse=True))
    return RestoreFailed(f"{remote.description} holds committed checkpoints of this run (steps {steps}) but none "
                         f"could be brought back: {reasons}. Nothing was changed there, and training does not start "
                         f"fresh on top of them. Run again (a download may have been damaged in transit), or start "
                         f"over with --fresh --overwrite to discard them")
