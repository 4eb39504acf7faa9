"""Which folders of a remote run folder are durable checkpoints, and why the others are not.

A remote checkpoint is durable once its manifest is there and valid (read and checked like a local one) and
every file it lists is there with its size: in its own folder, or in the older folder the manifest places it in
(placement.py), and with the md5 the manifest records for it, where it records one and the remote reports one
(Drive does; placement.remote_body writes what the upload reported). That check downloads only the manifest;
``deep`` downloads every file and checks its sha256, as a local verify does. The remote is untrusted (anyone
may write to a shared Drive folder): names from a manifest or a listing must be plain names, and a manifest
larger than any real one is not even downloaded.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from ..checkpoint import format as fmt
from ..checkpoint import manifest as manifests
from ..checkpoint import paths
from ..checkpoint.layout import Layout, step_of
from . import placement
from .base import RemoteStore, run_of, same_run
from .placement import Listings
from .retry import MissingFile

# A real manifest is a few KB; one larger than this on the remote is not downloaded at all.
MAX_MANIFEST_BYTES = 4 << 20
INCOMPLETE = "incomplete upload (no manifest yet)"
DELETED = "deleted while it was being read"


def md5_of(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with paths.open_regular(path) as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _download_checked(remote: RemoteStore, folder: str, name: str, target: Path, md5: str | None) -> None:
    """Download ``name``; when its bytes differ from the md5 the remote lists for it (corrupted in transit), once
    more. A manifest damaged on the way would otherwise make a committed checkpoint look invalid, and a run dir
    look as if it held none."""
    remote.get_file(folder, name, target)
    if md5 is not None and md5_of(target) != md5:
        remote.get_file(folder, name, target)


def check_remote(remote: RemoteStore, folder: str, scratch: Path,
                 listings: Listings | None = None) -> tuple[dict | None, str | None]:
    """(manifest, None) when the remote checkpoint ``folder`` is complete: its manifest is valid (read and checked
    like a local one, see manifests.read), every file it lists is a plain name and is present with its size
    (and md5, where both sides have one), in ``folder`` or in the older folder its entry places it in. Otherwise
    (None, why not). ``listings``: a cache of folder listings shared by several calls."""
    manifest, reason, _ = _check(remote, folder, scratch, listings or Listings(remote))
    return manifest, reason


def _check(remote: RemoteStore, folder: str, scratch: Path,
           listings: Listings) -> tuple[dict | None, str | None, str]:
    """check_remote, plus what was checked: "sizes and md5" when every file's md5 was compared, else "sizes"."""
    manifest, reason = _read_listed(remote, folder, scratch, listings)
    if manifest is None:
        return None, reason, "sizes"
    compared = 0
    for name, expected in manifest["files"].items():
        where = placement.folder_of(expected, folder)
        found = listings.get(folder) if where == folder else listings.files(where)
        recorded, reported = expected.get("md5"), found[name].md5
        if isinstance(recorded, str) and reported:
            if recorded.lower() != reported.lower():
                there = "" if where == folder else f" in {where}"
                return None, (f"{name}{there} does not match the md5 its manifest records (the copy on the remote "
                              f"is corrupt)"), "sizes and md5"
            compared += 1
    return manifest, None, "sizes and md5" if compared == len(manifest["files"]) else "sizes"


def _read_listed(remote: RemoteStore, folder: str, scratch: Path,
                 listings: Listings) -> tuple[dict | None, str | None]:
    """The size check of check_remote (the manifest read and validated, each listed file present with its size)."""
    try:
        files = listings.get(folder)
    except MissingFile:  # the folder was pruned after the checkpoint listing (inspect beside a live run)
        return None, DELETED
    if fmt.MANIFEST not in files:
        return None, INCOMPLETE
    if files[fmt.MANIFEST].size > MAX_MANIFEST_BYTES:
        return None, f"invalid: its manifest.json has {files[fmt.MANIFEST].size} bytes (at most {MAX_MANIFEST_BYTES})"
    # Into a scratch folder named like the checkpoint, so the manifest is checked exactly as a local one is (a
    # temp name: one a kill leaves behind is removed by the next start's cleanup_incomplete).
    holder = Path(tempfile.mkdtemp(prefix=f".remote-manifest{fmt.TMP_MARK}", dir=scratch))
    try:
        (holder / folder).mkdir()
        try:
            _download_checked(remote, folder, fmt.MANIFEST, holder / folder / fmt.MANIFEST, files[fmt.MANIFEST].md5)
        except MissingFile:  # pruned between listing and reading
            return None, DELETED
        try:
            manifest = manifests.read(holder / folder).body
        except fmt.InvalidCheckpoint as e:
            return None, f"invalid: {e}"
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not listed:
        return None, "invalid: its manifest lists no files"
    for name, expected in listed.items():
        if paths.name_problem(name) is not None:
            return None, f"invalid: its manifest lists {name!r}, not a plain file name ({paths.name_problem(name)})"
        size = expected.get("size") if isinstance(expected, dict) else None
        where = placement.folder_of(expected, folder)
        found, there = (files, "") if where == folder else (listings.files(where), f" in {where}")
        if name not in found:
            return None, f"incomplete upload ({name} is missing{there})"
        if found[name].size != size:
            return None, f"incomplete upload ({name}{there} has {found[name].size} bytes, the manifest says {size})"
    return manifest, None


def remote_manifest(remote: RemoteStore, folder: str, scratch: Path) -> dict | None:
    """The remote manifest of ``folder`` if it is complete and valid (see :func:`check_remote`), else None."""
    return check_remote(remote, folder, scratch)[0]


def remote_entries(remote: RemoteStore, scratch: Path,
                   layout: Layout | None = None) -> list[tuple[int, str, dict | None, str | None]]:
    """(step, folder, manifest or None, why not) of every remote checkpoint folder (of ``layout``; None: of any),
    oldest first. A folder without a manifest that holds files of durable checkpoints is a holder (placement.py),
    not an unfinished upload."""
    return [entry[:4] for entry in _entries(remote, scratch, deep=False, layout=layout)]


def _entries(remote: RemoteStore, scratch: Path, deep: bool,
             layout: Layout | None = None) -> list[tuple[int, str, dict | None, str | None, str]]:
    """remote_entries, plus what was checked of each (see _check; "sizes and sha256" when ``deep``)."""
    found, listings = [], Listings(remote)
    for folder in remote.list_checkpoints():
        step = layout.parse(folder) if layout is not None else step_of(folder)
        if step is not None and paths.is_plain_name(folder):
            manifest, reason, checked = _check(remote, folder, scratch, listings)
            if manifest is not None and deep:
                reason, checked = hash_remote(remote, folder, manifest, scratch), "sizes and sha256"
                manifest = manifest if reason is None else None
            found.append((step, folder, manifest, reason, checked))
    held = placement.uses((folder, manifest) for _, folder, manifest, _, _ in found if manifest is not None)
    found = [(step, folder, manifest, placement.HOLDER if reason == INCOMPLETE and folder in held else reason,
              checked) for step, folder, manifest, reason, checked in found]
    return sorted(found, key=lambda item: item[0])


def hash_remote(remote: RemoteStore, folder: str, manifest: dict, scratch: Path) -> str | None:
    """Download each file of a complete remote checkpoint, one at a time, and check its size and sha256 against the
    manifest; None when all match, else why not. The only check that reads the bytes themselves."""
    holder = Path(tempfile.mkdtemp(prefix=f".remote-hash{fmt.TMP_MARK}", dir=scratch))
    try:
        for name, expected in sorted(manifest["files"].items()):
            where = placement.folder_of(expected, folder)
            there = "" if where == folder else f" in {where}"
            target = holder / name  # a plain name: checked by _check before
            try:
                remote.get_file(where, name, target)
            except MissingFile:
                return f"{name}{there} was deleted while it was being read"
            size = target.stat().st_size
            if size != expected["size"]:
                return f"{name}{there} has {size} bytes, the manifest says {expected['size']}"
            if fmt.file_digest(target, expected) != expected["sha256"]:
                return f"{name}{there} does not match its sha256 (the copy on the remote is corrupt)"
            target.unlink()
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    return None


def remote_checkpoints(remote: RemoteStore, scratch: Path,
                       layout: Layout | None = None) -> list[tuple[int, str, dict | None]]:
    """(step, folder, manifest or None when not durable) of every remote checkpoint folder, oldest first."""
    return [(step, folder, manifest) for step, folder, manifest, _ in remote_entries(remote, scratch, layout)]


def describe_remote(remote: RemoteStore, scratch: Path, deep: bool = False) -> list[dict]:
    """One entry per remote checkpoint folder, oldest first, saying whether it is durable and what was checked
    ("checked": "sizes", "sizes and md5", or with ``deep`` "sizes and sha256", which downloads every file)."""
    entries = []
    for step, folder, manifest, reason, checked in _entries(remote, scratch, deep):
        entries.append({"step": step, "epoch": (manifest or {}).get("epoch"), "durable": manifest is not None,
                        "checked": checked,
                        "valid": manifest is not None, "reason": reason,
                        "fingerprint": (manifest or {}).get("fingerprint"),
                        "path": f"{remote.description}/{folder}",
                        "created": (manifest or {}).get("created_unix"), "run_id": run_of(manifest),
                        "test_acc": ((manifest or {}).get("metrics") or {}).get("test_acc"),
                        "metrics": (manifest or {}).get("metrics") or {}, "best": (manifest or {}).get("best")})
    return entries


def durable_steps(remote: RemoteStore, scratch: Path, run_id: str | None = None) -> list[int]:
    """Steps whose checkpoint is complete on the remote, oldest first; with ``run_id``, only those that may
    belong to that run (same or unknown run id)."""
    return [entry["step"] for entry in describe_remote(remote, scratch)
            if entry["durable"] and same_run(entry["run_id"], run_id)]
