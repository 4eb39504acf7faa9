"""The path policy: which names resumable accepts, which files it opens, and how it deletes.

A run dir may be shared, synced, symlinked or damaged (GUIDE 13), so nothing read back decides where resumable
reads, writes or deletes:

* **Names are plain.** The format puts a checkpoint's files directly in its step dir, and a Drive folder's files
  directly in that folder, so a name from a manifest or a Drive listing is one plain component
  (:func:`plain_name`). An absolute path, ``..``, a separator, a NUL or an empty name is damage or an attack,
  never layout: ``Path(dir) / "/dev/zero"`` *is* ``/dev/zero``, and a Drive title ``../../x`` would be written
  outside the cache.
* **Only regular files are opened for reading** (:func:`open_regular`): ``lstat`` first (a FIFO blocks ``open``
  forever, ``/dev/zero`` never ends, a symlink reads someone else's file), then ``O_NOFOLLOW | O_NONBLOCK`` so
  that a link or FIFO swapped in after the ``lstat`` can neither redirect nor hang the open, and ``fstat`` checks
  that what was opened is still a regular file.
* **Deleting never follows a symlink** (:func:`remove_entry`, :func:`remove_tree`): a link found where a step dir
  or the TensorBoard dir belongs is removed itself (and the log says so); what it points to is outside the run
  dir and is never touched. ``shutil.rmtree`` on Linux already walks by file descriptor without following links
  inside the tree; only the top-level path needs the check.
* **Writes replace, never write through** (:func:`write_replacing`): a file brought back from Drive is written to
  a new temp file beside it and renamed into place, so a link or FIFO already at its name is replaced.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from .. import log

Say = Callable[[str], None]
NAME_MAX = 255  # bytes in one file name on every file system resumable targets (ext4, tmpfs, FUSE mounts)
_FORBIDDEN = ("/", "\\", "\0")  # "\\": a separator on Windows, and never part of a name the format writes
_warned: set[str] = set()


class UnsafePath(ValueError):
    """A name or path that the path policy refuses; the message says what it is and what to do."""


class NotRegularFile(OSError):
    """A path that exists but is not a regular file (a FIFO, a device, a directory, a symlink)."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{path} is {kind}, not a regular file; resumable reads only regular "
                                       f"files in a run dir (put the real file there, or remove it)")
        self.path, self.kind = path, kind


def name_problem(name: Any) -> str | None:
    """Why ``name`` is not a plain file name inside its folder, or None when it is one."""
    if not isinstance(name, str):
        return f"a name must be a string, not {type(name).__name__}"
    if not name:
        return "the name is empty"
    if name in (".", ".."):
        return f"{name!r} names a folder, not a file in it"
    if name.startswith("/"):
        return "an absolute path"
    bad = next((c for c in _FORBIDDEN if c in name), None)
    if bad is not None:
        return f"it contains {bad!r} (a path, not a name)"
    try:
        encoded = os.fsencode(name)
    except UnicodeEncodeError:
        return "it cannot be encoded as a file name"
    if len(encoded) > NAME_MAX:
        return f"it is {len(encoded)} bytes long, more than a file name may be ({NAME_MAX})"
    return None


def is_plain_name(name: Any) -> bool:
    return name_problem(name) is None


def plain_name(name: Any, where: str) -> str:
    """``name`` when it is a plain file name; raises UnsafePath naming it, ``where`` it came from, and why."""
    problem = name_problem(name)
    if problem is not None:
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        raise UnsafePath(f"{where} names the file {shown}, which is not a plain name inside its folder ({problem}); "
                         f"it was refused, nothing outside the folder is read or written")
    return name


def warn_once(key: str, message: str, say: Say | None = None) -> None:
    """Say ``message`` the first time ``key`` is seen in this process (listings repeat every few seconds)."""
    if key not in _warned:
        _warned.add(key)
        (say or log.warning)(message)


def describe(mode: int) -> str:
    for test, kind in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a file"


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def regular_stat(path: Path) -> os.stat_result:
    """``lstat`` of ``path``, which must be a regular file; FileNotFoundError or NotRegularFile otherwise."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        kind = describe(info.st_mode)
        if stat.S_ISLNK(info.st_mode):
            kind += f" (to {_link_target(path)})"
        raise NotRegularFile(Path(path), kind)
    return info


def is_regular(path: Path) -> bool:
    """A regular file itself (``Path.is_file`` follows links: a symlinked log would read someone else's file)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def write_replacing(directory: Path, name: str, write: Callable[[Path], None], where: str = "") -> Path:
    """Create ``directory/name`` by ``write(temp path)`` into a new temp file in ``directory``, then rename it into
    place: whatever was at that name (a symlink, a FIFO) is replaced, never written through. ``name`` must be a
    plain name (raises UnsafePath naming ``where`` it came from)."""
    plain_name(name, where or str(directory))
    handle, tmp = tempfile.mkstemp(prefix=".fetch.tmp-", dir=directory)  # O_EXCL: a new file of our own
    os.close(handle)
    try:
        write(Path(tmp))
        os.replace(tmp, directory / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return directory / name


def open_regular(path: Path) -> BinaryIO:
    """Open ``path`` for reading in binary mode, only if it is a regular file (see the module docstring)."""
    regular_stat(path)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:  # replaced by a symlink after the lstat
            raise NotRegularFile(Path(path), "a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # replaced by a FIFO or device after the lstat
            raise NotRegularFile(Path(path), describe(info.st_mode))
        # O_NONBLOCK means nothing for a regular file's reads, but clear it so nothing downstream is surprised.
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def fd_path(fd: int, fallback: Path) -> str:
    """A path that opens the very file ``fd`` is open on (Linux: /proc/self/fd/N), for APIs that want a name
    (``torch.load(mmap=True)``); elsewhere the original path, checked just before."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else str(fallback)


def is_link(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def is_real_dir(path: Path) -> bool:
    """A directory itself, not a symlink to one (``Path.is_dir`` follows links)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def kind_of(path: Path) -> str:
    """What is at ``path``, for messages: "a directory", "a symbolic link (to X)", "a FIFO (named pipe)", ..."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "missing"
    return describe(mode) + (f" (to {_link_target(path)})" if stat.S_ISLNK(mode) else "")


def unlink_in_dir(directory: Path, name: str) -> bool:
    """Unlink ``directory/name`` through a descriptor of ``directory`` opened with O_NOFOLLOW, so a link swapped
    in for ``directory`` can never make this delete a file somewhere else. Returns whether it was there."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return False
        os.fsync(fd)
        return True
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Delete the directory ``path`` and everything in it, without ever following a symbolic link.

    A link at ``path`` itself is refused with UnsafePath (removing a link is :func:`remove_entry`'s choice to
    make, with a message); links inside the tree are removed as links by ``shutil.rmtree``."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafePath(f"refusing to delete {path} recursively: it is a symbolic link to {_link_target(path)}, and "
                         f"following it would delete files outside the run dir; remove the link itself "
                         f"(rm {path}) if it is not wanted")
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(path)
        return
    if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - only platforms without fd-based rmtree
        log.warning(f"this platform's shutil.rmtree may follow a link swapped into {path} while it deletes")
    shutil.rmtree(path)


def remove_entry(path: Path, say: Say | None = None) -> bool:
    """Remove whatever is at ``path`` (a run-dir entry: a step dir, the TensorBoard dir, a temp file) without
    following a symlink: a link is unlinked itself and ``say`` tells the user; a directory is deleted with its
    contents. Returns whether something was there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode):
        target = _link_target(path)
        os.unlink(path)
        (say or log.warning)(f"{path} was a symbolic link (to {target}): removed the link only; what it points to "
                             f"is outside the run dir and was not changed")
    elif stat.S_ISDIR(info.st_mode):
        remove_tree(path)
    else:
        os.unlink(path)
    return True


def real_dir(path: Path, say: Say | None = None) -> Path:
    """Make ``path`` a real directory before writing into it: a symlink there is removed (and said), never
    written through, so files brought back from Drive land inside the run dir."""
    if is_link(path):
        remove_entry(path, say)
    path.mkdir(parents=True, exist_ok=True)
    return path
