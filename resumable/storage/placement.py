"""Where a remote checkpoint's files are stored, so that bytes already durable there are not uploaded again.

Consecutive checkpoints often share files byte for byte (a shard the writer hard-linked to the previous
checkpoint's, see checkpoint/sharded.py). On the remote such a file is stored once, in the folder of an older
checkpoint, and the newer checkpoint's remote manifest names that folder in the file's entry::

    "files": {"shard-00000.safetensors": {"size": 123, "sha256": "...", "folder": "step-000000100"}}

A remote manifest differs from the local one only by those keys (re-sealed, since it carries a self-checksum;
checkpoint/manifest.py validates them). Locally the keys are only hints: a local checkpoint holds all its files.

A pruned checkpoint whose files newer ones still use is not deleted as a whole: its manifest goes (it is no
checkpoint any more), then the files nothing uses; the rest stays, a "holder", deleted once nothing uses it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..checkpoint import format as fmt
from ..checkpoint.layout import step_of
from ..checkpoint.manifest import seal
from .base import RemoteFile, RemoteStore
from .retry import MissingFile

FOLDER = "folder"
MD5 = "md5"  # of a file's bytes as the remote reported them when it was uploaded (optional)
HOLDER = "holds files of newer checkpoints (its own checkpoint was pruned)"
Key = tuple[str, int, str]  # (name, size, sha256): the same bytes under the same name
# A smaller file is uploaded again: that costs about what checking it is still there does, and it never keeps a
# pruned checkpoint's folder around (a small meta.pt equal to the last one's would, checkpoint after checkpoint).
MIN_REUSE_BYTES = 1 << 20


def folder_of(entry: dict[str, Any], own: str) -> str:
    """The remote folder holding the bytes of a manifest entry of the checkpoint in folder ``own``."""
    placed = entry.get(FOLDER) if isinstance(entry, dict) else None
    return placed if isinstance(placed, str) else own


def _key(name: str, entry: dict[str, Any]) -> Key:
    return name, entry["size"], entry["sha256"]


def uses(manifests: Iterable[tuple[str, dict[str, Any]]]) -> dict[str, set[str]]:
    """Folder -> names of its files that the given (folder, manifest) checkpoints place there from elsewhere."""
    found: dict[str, set[str]] = {}
    for own, manifest in manifests:
        for name, entry in manifest["files"].items():
            where = folder_of(entry, own)
            if where != own:
                found.setdefault(where, set()).add(name)
    return found


def remote_body(local: dict[str, Any], reused: dict[str, str], md5: dict[str, str] | None = None) -> dict[str, Any]:
    """The remote manifest of a local one whose files ``reused`` (name -> folder) are stored elsewhere. Placement
    keys the local one carries (it was brought back from the remote) are replaced: where the bytes are now.
    ``md5``: what the remote reported for the files just uploaded (name -> md5), recorded so that a later check
    (`resumable verify gdrive://...`, durable.py) compares what Drive reports without downloading anything."""
    files = {}
    for name, entry in local["files"].items():
        files[name] = {k: v for k, v in entry.items() if k != FOLDER}  # an md5 it carries stays: same sha256,
        if name in reused:                                                  # same bytes, same md5
            files[name][FOLDER] = reused[name]
        elif name in (md5 or {}):
            files[name][MD5] = md5[name]
    body = {**local, "files": files}
    return local if body == local else seal(body)


class Listings:
    """Remote folder listings, each read at most once (per pass of the Mirror, per look at the remote)."""

    def __init__(self, remote: RemoteStore) -> None:
        self.remote = remote
        self._cache: dict[str, dict[str, RemoteFile] | None] = {}

    def get(self, folder: str) -> dict[str, RemoteFile]:
        """The listing of ``folder``; MissingFile when it was deleted meanwhile (a folder never made lists empty)."""
        if folder not in self._cache:
            try:
                self._cache[folder] = self.remote.list_files(folder)
            except MissingFile:
                self._cache[folder] = None
        listed = self._cache[folder]
        if listed is None:
            raise MissingFile(f"{folder} was deleted on {self.remote.description}")
        return listed

    def files(self, folder: str) -> dict[str, RemoteFile]:
        """The listing of ``folder``, empty when it is gone."""
        try:
            return self.get(folder)
        except MissingFile:
            return {}

    def forget(self, folder: str) -> None:
        self._cache.pop(folder, None)


class Placements:
    """What a Mirror knows of the remote: where the bytes of each (name, size, sha256) of its run are stored, and
    the remote manifest of every durable checkpoint it knows of (of any run: their placements keep files)."""

    def __init__(self) -> None:
        self._where: dict[Key, str] = {}
        self._md5: dict[tuple[str, str], str] = {}  # (folder, name) -> md5 the remote reported for our upload
        self.manifests: dict[str, dict[str, Any]] = {}
        self._held: dict[str, set[str]] = {}  # holder folder -> the names it was left with

    def learn(self, folder: str, manifest: dict[str, Any], ours: bool, md5: dict[str, str] | None = None) -> None:
        """A durable remote checkpoint: its placements count for retention; those of this run (``ours``) are
        reused by later uploads. ``md5``: what the remote reported for the files just uploaded there."""
        self.manifests[folder] = manifest
        self._held.pop(folder, None)
        if not ours:
            return
        for name, entry in manifest["files"].items():
            self._where[_key(name, entry)] = folder_of(entry, folder)
        for name, digest in (md5 or {}).items():
            self._md5[(folder, name)] = digest

    def find(self, name: str, entry: dict[str, Any], step: int, listings: Listings) -> str | None:
        """The folder of an older checkpoint of this run where the bytes of ``name`` are durable (listed there with
        their size, and the md5 this process saw when it uploaded them), or None: upload it."""
        if entry["size"] < MIN_REUSE_BYTES:
            return None
        key = _key(name, entry)
        where = self._where.get(key)
        older = step_of(where) if where is not None else None
        if where is None or older is None or older >= step:
            return None
        got = listings.files(where).get(name)
        known = self._md5.get((where, name))
        if got is None or got.size != entry["size"] or (known and got.md5 and got.md5 != known):
            self._where.pop(key, None)  # deleted or replaced by someone: the new checkpoint stores its own copy
            return None
        return where

    def in_use(self, doomed: Iterable[str]) -> dict[str, set[str]]:
        """Folder -> names that the known checkpoints other than the ``doomed`` folders place there."""
        gone = set(doomed)
        return uses((folder, m) for folder, m in self.manifests.items() if folder not in gone)

    def needs_work(self, folder: str, keep: set[str]) -> bool:
        """Whether a folder to be kept as a holder of ``keep`` still holds more than that (as far as known)."""
        return self._held.get(folder) != keep

    def held(self, folder: str, keep: set[str], deleted: Iterable[str]) -> None:
        """``folder`` is a holder of ``keep`` now: its manifest and the ``deleted`` files are gone."""
        self.manifests.pop(folder, None)
        self._held[folder] = set(keep)
        self._forget(folder, set(deleted))

    def dropped(self, folder: str) -> None:
        """``folder`` was deleted as a whole."""
        self.manifests.pop(folder, None)
        self._held.pop(folder, None)
        self._forget(folder, None)

    def _forget(self, folder: str, names: set[str] | None) -> None:
        for key, where in list(self._where.items()):
            if where == folder and (names is None or key[0] in names):
                del self._where[key]
        for where, name in list(self._md5):
            if where == folder and (names is None or name in names):
                del self._md5[(where, name)]


def make_holder(remote: RemoteStore, folder: str, keep: set[str]) -> list[str]:
    """Turn the remote ``folder`` into a holder of ``keep``: its manifest first (it stops being a checkpoint at
    once), then every other file. Returns the names deleted."""
    try:
        files = remote.list_files(folder)
    except MissingFile:
        return []
    doomed = sorted(name for name in files if name not in keep and name != fmt.MANIFEST)
    if fmt.MANIFEST in files:
        doomed.insert(0, fmt.MANIFEST)
    for name in doomed:
        remote.delete_file(folder, name)
    return doomed
