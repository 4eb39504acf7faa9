"""The state-writer seam: how a checkpoint's state becomes files in its step directory, and back.

The manager owns the commit protocol (step directory, manifest written last, retention); a
:class:`StateFormat` only writes the payload files of one state into a directory and reads them back.
:class:`TorchFile` is the layout of formats 1 and 2: one ``state.pt`` (``torch.save`` of plain containers and
tensors, loaded with ``weights_only=True`` and memory-mapped, so N ranks reading one checkpoint share its pages).
Format 3 writes :class:`~resumable.checkpoint.sharded.ShardedFormat` (safetensors shards and a small
``meta.pt``); the manager reads either, by the files a manifest lists (manager.read_any). Both formats return
a :class:`Written`.

A payload whose sha256 matches its manifest can still be hostile: pickle's memo lets 1 KB describe a list
of lists that references one list twice at every level, 2^60 leaves when walked, and everything after the
load (fingerprint, ``load_state_dict``) walks it as a tree. So :func:`check_structure` measures the payload
*as a tree* before anything walks it, in time proportional to its distinct containers, and refuses one that
is too large, nested too deeply or cyclic. Legitimate payloads do share containers (a synchronous save
references the RNG dict from ``rng`` and ``ranks[0]``; Adam's param groups share one ``betas`` tuple), so
sharing itself is allowed: only the size a walk would pay is bounded.

Loading has a time bound (``RESUMABLE_LOAD_TIMEOUT_S``, default 600 s), checked between the steps of reading
a checkpoint; ``torch.load`` itself cannot be interrupted, so the bound is noticed right after it returns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..envvars import env_number
from . import format as fmt
from .snapshot import Snapshotter

LOAD_TIMEOUT_ENV = "RESUMABLE_LOAD_TIMEOUT_S"
DEFAULT_LOAD_TIMEOUT_S = 600.0
# Far above a real payload (a GPT-2 state with Adam is ~2,000 containers and tensors; tensors count once),
# far below what would hang: walking 10 million nodes takes seconds.
MAX_NODES = 10_000_000
# The engine's own walkers (fingerprint, snapshot, load_state_dict) recurse; Python stops at ~1000 frames.
MAX_DEPTH = 100
_CONTAINERS = (dict, list, tuple, set, frozenset)


@dataclass(frozen=True)
class Previous:
    """A file of the previous committed checkpoint, which an identical new file may be linked to."""

    path: Path
    size: int
    sha256: str
    digest: str | None = None  # the entry's "digest" field: how ``sha256`` was computed (format.file_digest)

    @property
    def entry(self) -> dict[str, Any]:
        """As a manifest entry (what format.file_digest takes)."""
        return {"size": self.size, "sha256": self.sha256, **({"digest": self.digest} if self.digest else {})}


@dataclass
class Written:
    """What one save wrote: the files for the manifest, the fingerprint, and where the bytes went."""

    files: dict[str, dict[str, Any]]
    fingerprint: str
    fingerprint_version: int
    written: int = 0  # bytes written to disk
    linked: int = 0  # bytes of shards hard-linked from the previous checkpoint (not written again)
    staged: int = 0  # bytes copied into the staging memory on the training thread
    direct: int = 0  # bytes handled on the training thread because they did not fit the staging memory


class StateFormat(Protocol):
    name: str
    load_timeout_s: float

    def begin(self, directory: Path, state: dict[str, Any], previous: Any = None, staging: Any = None) -> Any:
        """The training thread's part of a save; the result's ``finish()`` (on the writer's thread) returns a
        :class:`Written`."""
        ...

    def write(self, directory: Path, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Write ``state`` into ``directory``; returns ``{file name: {"size", "sha256"}}`` of every file."""
        ...

    def read(self, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """The state written by :meth:`write` (raises InvalidCheckpoint when it cannot be read safely)."""
        ...


def load_timeout_from_env() -> float:
    return env_number(LOAD_TIMEOUT_ENV, DEFAULT_LOAD_TIMEOUT_S)


class Deadline:
    """The time bound of loading one checkpoint; :meth:`check` says which file it was on when exceeded."""

    def __init__(self, seconds: float, directory: Path, clock=time.monotonic) -> None:  # noqa: ANN001 - a clock
        self.seconds, self.directory, self.clock = seconds, directory, clock
        self.end = clock() + seconds

    def check(self, name: str, doing: str) -> None:
        if self.clock() > self.end:
            raise fmt.InvalidCheckpoint(
                f"loading took longer than {self.seconds:g}s (on {name}, {doing}); the file system may be "
                f"stalled or the payload hostile. Set {LOAD_TIMEOUT_ENV} to allow more time if it is just slow")


def _children(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield key
            yield value
    else:
        yield from obj
    extra = getattr(obj, "__dict__", None)  # an OrderedDict state_dict's _metadata travels in the payload too
    if isinstance(extra, dict) and extra:
        yield from extra.values()


def check_structure(obj: Any, name: str = fmt.PAYLOAD, deadline: Deadline | None = None,
                    max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH) -> int:
    """The number of nodes a walk of ``obj`` as a tree visits (containers and leaves; a tensor is one leaf).

    Raises InvalidCheckpoint ("payload structure ...") when that exceeds ``max_nodes``, nesting exceeds
    ``max_depth`` or a container contains itself. Iterative, and each distinct container is expanded once (its
    tree size memoised by ``id``), so a memo bomb costs what its few distinct lists cost, not 2^60."""
    sizes: dict[int, int] = {}  # id -> tree size of a container already measured (all alive inside ``obj``)
    if not isinstance(obj, _CONTAINERS):
        return 1
    on_path = {id(obj)}
    stack: list[tuple[Any, Iterator[Any], int]] = [(obj, _children(obj), 1)]  # (container, children, size so far)
    steps = 0
    while stack:
        steps += 1
        if deadline is not None and steps % 65536 == 0:
            deadline.check(name, "checking its structure")
        container, children, size = stack[-1]
        child = next(children, _END)
        if child is _END:
            stack.pop()
            on_path.discard(id(container))
            sizes[id(container)] = size
            if stack:
                parent, parent_children, parent_size = stack[-1]
                stack[-1] = (parent, parent_children, _add(parent_size, size, name, max_nodes))
            continue
        if not isinstance(child, _CONTAINERS):
            stack[-1] = (container, children, _add(size, 1, name, max_nodes))
        elif id(child) in sizes:  # shared: a walk pays its whole subtree again
            stack[-1] = (container, children, _add(size, sizes[id(child)], name, max_nodes))
        elif id(child) in on_path:
            raise fmt.InvalidCheckpoint(f"{name}: payload structure is cyclic (a {type(child).__name__} contains "
                                        f"itself); resumable never writes one, so the file is damaged or hostile")
        elif len(stack) >= max_depth:
            raise fmt.InvalidCheckpoint(f"{name}: payload structure is nested more than {max_depth} levels deep; "
                                        f"resumable's payloads are a few levels deep, so the file is damaged or "
                                        f"hostile")
        else:
            on_path.add(id(child))
            stack.append((child, _children(child), 1))
    return sizes[id(obj)]


_END = object()


def _add(total: int, more: int, name: str, max_nodes: int) -> int:
    total += more
    if total > max_nodes:
        raise fmt.InvalidCheckpoint(f"{name}: payload structure would have more than {max_nodes:,} nodes when walked "
                                    f"(containers shared many times: a pickle memo bomb, or damage); refused before "
                                    f"anything walks it")
    return total


class TorchPending:
    """A TorchFile save between its training-thread part (the host snapshot) and its background part."""

    def __init__(self, directory: Path, state: dict[str, Any]) -> None:
        self.directory, self.state = directory, state

    def finish(self) -> Any:
        entry = fmt.write_payload(self.directory, self.state)
        return Written({fmt.PAYLOAD: entry}, fmt.fingerprint(self.state.get("model"), self.state.get("optimizer")), 1,
                       written=entry["size"])


class TorchFile:
    """Format 1: the whole state in one ``state.pt``.

    ``load_timeout_s``: the time bound of :meth:`read` (default: ``$RESUMABLE_LOAD_TIMEOUT_S``, else 600 s)."""

    name = "torch-file"

    def __init__(self, load_timeout_s: float | None = None) -> None:
        if load_timeout_s is not None and not (load_timeout_s > 0 and math.isfinite(load_timeout_s)):
            raise ValueError(f"load_timeout_s={load_timeout_s!r} must be a number of seconds > 0")
        self.load_timeout_s = load_timeout_from_env() if load_timeout_s is None else float(load_timeout_s)
        self._snapshotter = Snapshotter()  # the host buffers of asynchronous saves, reused from save to save

    def write(self, directory: Path, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {fmt.PAYLOAD: fmt.write_payload(directory, state)}

    def begin(self, directory: Path, state: dict[str, Any], previous: Any = None, staging: Any = None) -> TorchPending:
        """A save in two parts, like ShardedFormat.begin: with ``staging`` (an asynchronous save) the state is
        copied into host buffers first (the whole state: this format has no staging budget)."""
        if staging is not None:
            state = self._snapshotter.take(state)
        return TorchPending(Path(directory), state)

    def read(self, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        deadline = Deadline(self.load_timeout_s, directory)
        payload = fmt.load_payload(directory / fmt.PAYLOAD)
        deadline.check(fmt.PAYLOAD, "in torch.load")  # torch.load cannot be interrupted: checked once it returns
        if not isinstance(payload, dict):
            raise fmt.InvalidCheckpoint(f"{directory} holds a {type(payload).__name__}, not a checkpoint")
        check_structure(payload, fmt.PAYLOAD, deadline)
        return payload
