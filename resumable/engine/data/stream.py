"""Iterable data (streams) for :class:`~resumable.engine.run.Run`, resumed exactly where the last trained batch
left off.

A stream has no indices: batches come in the order it yields them, and an epoch ends when it is exhausted (its
length is learnt from the first epoch). Two kinds:

* a **dataset** (``torch.utils.data.IterableDataset``, a Hugging Face ``datasets`` streaming ``IterableDataset``,
  any re-iterable object): read through a ``DataLoader`` whose workers (``num_workers``; none: the training
  process) each iterate their copy of the dataset, take ``batch_size`` samples, collate them (``collate_fn``)
  and tag the batch with (worker, count, the dataset's ``state_dict()`` after it). The training process takes
  batches from the workers in a fixed round-robin order, so the order depends on the workers' streams only, and
  a checkpoint records, for each worker, its tag of the last batch the loop *trained*: prefetched batches are
  neither lost nor repeated.

  - With the ``state_dict()``/``load_state_dict()`` protocol a worker resumes by loading its state: O(1).
  - Without it a worker replays its stream from the start of the epoch and drops the batches it had produced;
    the time that takes is reported, with how to avoid it.

  Randomness inside the dataset's ``__iter__`` and ``collate_fn`` (augmentation, masking) is seeded per batch
  from (seed, epoch, worker, count), as for map-style data, so a resumed or replayed batch is the same. The
  user's dataset object never gets a checkpoint's state loaded into it: workers hold copies, and in the
  training process a copy is made at a resume. ``set_epoch(epoch)`` is called before each epoch where the
  dataset has it.
* a **loader** with the protocol (torchdata's ``StatefulDataLoader``), or a plain ``DataLoader`` over an
  iterable dataset: iterated as it is; its ``state_dict()`` after each batch (and after its last, once it is
  exhausted) is the position. A plain ``DataLoader`` resumes by replay.
"""

from __future__ import annotations

import copy
import itertools
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from ... import log
from ...errors import ResumableError, ResumeNotApplied
from .sampler import epoch_seed
from .sources import _Seeded, batch_seed, shut_down, worker_options

_RESERVED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "generator")
_END = -1  # the size of a worker's end-of-stream mark
_FAILED = -2  # the size of a worker's report that its dataset could not load its saved position


def has_protocol(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def refilled_on_load(dataset: Any) -> str | None:
    """Why ``dataset``'s ``state_dict()`` does not hold its exact position (None: no known reason).

    A Hugging Face ``datasets`` stream shuffled through a buffer (``.shuffle(buffer_size=...)``) saves no buffer:
    its ``load_state_dict`` refills the buffer from the stream, so the samples that were in it are lost and others
    come twice. Found by walking its chain of example iterables (``_ex_iterable``, ``ex_iterable(s)``)."""
    stack, seen = [getattr(dataset, "_ex_iterable", None)], 0
    while stack and seen < 1000:
        node, seen = stack.pop(), seen + 1
        if node is None:
            continue
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            size = getattr(node, "buffer_size", "?")
            return (f"it is a Hugging Face stream shuffled through a buffer of {size} samples, which its "
                    f"state_dict() leaves out (load_state_dict refills it, losing and repeating samples)")
        stack.append(getattr(node, "ex_iterable", None))
        stack.extend(getattr(node, "ex_iterables", None) or [])
    return None


def is_loader(data: Any) -> bool:
    return isinstance(data, DataLoader) or (has_protocol(data) and hasattr(data, "__iter__")
                                            and hasattr(data, "batch_size") and not hasattr(data, "__getitem__"))


def is_stream(data: Any) -> bool:
    """Iterable data: an ``IterableDataset``, a loader, or any iterable that is not map-style."""
    if isinstance(data, (IterableDataset, DataLoader)) or is_loader(data):
        return True
    return hasattr(data, "__iter__") and not (hasattr(data, "__getitem__") and hasattr(data, "__len__"))


def batch_size_of(batch: Any) -> int:
    """Samples in a collated batch: the first dimension of its first tensor (or the length of a list)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        if isinstance(value, (torch.Tensor, dict, list, tuple)):
            return batch_size_of(value)
    return len(batch) if hasattr(batch, "__len__") else 1


class _WorkerStream(IterableDataset):
    """Runs where the dataset is iterated (a DataLoader worker, or the training process): batches, collates and
    tags them, starting from this worker's saved position (its state, or a number of batches to replay)."""

    def __init__(self, dataset: Any, batch_size: int, collate: Callable, drop_last: bool, protocol: bool,
                 seed: int, epoch: int, start: list[dict[str, Any]]) -> None:
        self.dataset, self.batch_size, self.collate, self.drop_last = dataset, batch_size, collate, drop_last
        self.protocol, self.seed, self.epoch, self.start = protocol, seed, epoch, start

    def _take(self, items: Iterator[Any], worker: int, count: int, collate: bool) -> tuple[Any, int]:
        with _Seeded(batch_seed(self.seed, self.epoch, count, worker)):
            taken = list(islice(items, self.batch_size))
            if not taken or (self.drop_last and len(taken) < self.batch_size):
                return None, 0
            return (self.collate(taken) if collate else None), len(taken)

    def __iter__(self) -> Iterator[tuple[Any, int, int, int, int, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        start = self.start[worker] if worker < len(self.start) else {"count": 0, "samples": 0, "state": None}
        dataset, count, samples = self.dataset, start["count"], start["samples"]
        if start["state"] is not None:
            if info is None:  # the training process: the user's object must never hold a checkpoint's state
                dataset = copy.deepcopy(dataset)
            try:
                dataset.load_state_dict(start["state"])
            except Exception as e:  # noqa: BLE001 - reported by the training process as a resume error, not a
                # traceback from inside a worker (datasets' IndexError in a shuffled stream's load_state_dict)
                yield None, worker, count, _FAILED, samples, (type(e).__name__, str(e))  # plain text: always pickles
                return
        items = iter(dataset)
        if start["state"] is None:
            for replayed in range(count):  # no protocol: replay this worker's batches, under their seeds
                if self._take(items, worker, replayed, collate=False)[1] == 0:
                    break
        while True:
            batch, size = self._take(items, worker, count, collate=True)
            if size == 0:
                yield None, worker, count, _END, samples, None
                return
            count, samples = count + 1, samples + size
            yield batch, worker, count, size, samples, (dataset.state_dict() if self.protocol else None)


class _Stream(ABC):
    """What the loop and the run need from a stream: ``walk`` (batches with one batch of lookahead, so the last
    of an epoch is known when it is trained), ``epoch_done``, the position as a ``state_dict``, and ``epoch``
    (the run's fetch: the batch is the item)."""

    kind = "stream"

    def __init__(self, batch_size: int, seed: int) -> None:
        self.batch_size = batch_size
        self.seed = seed
        self.epoch_batches: int | None = None  # batches of the last complete epoch
        self.position: dict[str, Any] | None = None  # loaded from a checkpoint, used by the next walk
        self._consumed: dict[str, Any] = {}  # the position after the last batch handed to the loop
        self._ended: tuple[int, int] | None = None  # (epoch, batches) when that epoch's last batch was handed out
        self._iterator: Any = None
        self._ahead: tuple[int, int, Any] | None = None  # (epoch, index, batch) read ahead by walk, not yet trained
        self.owns_loader = False  # the DataLoader (and its workers) is this stream's own

    @property
    def batches_per_epoch(self) -> int | None:
        return self.epoch_batches

    def batches_in(self, epoch: int) -> int | None:
        return self.epoch_batches

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What must match between a checkpoint and this run (its options and kind)."""

    @abstractmethod
    def _fresh(self, position: dict[str, Any] | None) -> dict[str, Any]:
        """The kind's part of the position at the start of a walk (from ``position`` when resuming mid-epoch)."""

    @abstractmethod
    def _consume(self, mark: Any) -> None:
        """Record the position after the batch whose ``mark`` is given (it is handed to the loop)."""

    @abstractmethod
    def _open(self, epoch: int, first: int, position: dict[str, Any] | None) -> Iterator[tuple[Any, int, Any]]:
        """``(batch, size, mark)`` of the epoch from batch ``first``; a last ``(None, _END, mark)`` says the stream
        is exhausted (mark: the position after its last batch, or None to keep that batch's)."""

    def walk(self, epoch: int, first: int, device: torch.device | None = None
             ) -> Iterator[tuple[int, Any, int, bool]]:
        position, self.position = self.position, None
        if first and (position is None or (position["epoch"], position["batches"]) != (epoch, first)):
            saved = f"epoch {position['epoch']} batch {position['batches']}" if position else "no data position"
            raise ResumableError(f"the checkpoint resumes at epoch {epoch} batch {first} but holds {saved} for the "
                                 f"data stream; it was not written for this data. Start over with --fresh "
                                 f"--overwrite (or another run dir)")
        self._consumed = {"epoch": epoch, "batches": first, **self._fresh(position if first else None)}
        batches = self._open(epoch, first, position)
        index, pending = first, next(batches, None)
        while pending is not None and pending[1] != _END:
            following = next(batches, None)
            last = following is None or following[1] == _END
            self._consume(pending[2])
            if last and following is not None and following[2] is not None:
                self._consume(following[2])
            self._consumed["batches"] = index + 1
            if last:
                self._ended, self.epoch_batches = (epoch, index + 1), index + 1
            self._ahead = None if last else (epoch, index + 1, following[0])
            yield index, pending[0], pending[1], last
            index, pending = index + 1, following
        self._ahead = None
        if index == first:
            self._ended = (epoch, first)
            if epoch == 0 and first == 0:
                raise ValueError("the data yielded no batch in its first epoch; check that iterating it yields "
                                 f"samples (and that it holds at least batch_size={self.batch_size} with "
                                 f"drop_last=True)")

    def epoch_done(self, epoch: int, batch_in_epoch: int) -> bool:
        return self._ended == (epoch, batch_in_epoch)

    def upcoming(self, epoch: int, index: int) -> tuple[str, Any] | None:
        """The batch the stream produces at (epoch, index) when walk has already read it (engine/data/content_check.py);
        None at an epoch's start, where nothing is read ahead."""
        ahead = self._ahead
        return ("batch content", ahead[2]) if ahead is not None and ahead[:2] == (epoch, index) else None

    def epoch(self, _sampler: Any, _epoch: int, _start: int) -> Callable[[Any], Any]:
        return _same

    def close(self) -> None:
        if self.owns_loader:  # a user's loader (persistent workers, perhaps) is the user's to end
            shut_down(self._iterator)
        self._iterator = None
        self._ahead = None

    def state_dict(self) -> dict[str, Any]:
        return {**self.identity(), "position": copy.deepcopy(self._consumed), "epoch_batches": self.epoch_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.identity()
        diffs = [f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in mine.items() if state.get(k) != v]
        if diffs:
            raise ValueError("the data stream of this run differs from the checkpoint's (" + "; ".join(diffs)
                             + "): resume with the same data and options (a stream's position is per DataLoader "
                             "worker), or start over with --fresh --overwrite")
        self.position = copy.deepcopy(state["position"])
        self._consumed = copy.deepcopy(state["position"])
        self.epoch_batches = state.get("epoch_batches")

    def _replayed(self, batches: int, samples: int, seconds: float, avoid: str) -> None:
        if batches:
            log.warning(f"resumed the data stream by replaying {batches:,} batch(es) ({samples:,} samples) from the "
                        f"start of the epoch in {seconds:.2f}s, because {avoid}")


def _same(batch: Any) -> Any:
    return batch


class DatasetStream(_Stream):
    """An iterable dataset read by DataLoader workers (see the module docstring)."""

    def __init__(self, dataset: Any, batch_size: int, seed: int, drop_last: bool, **options: Any) -> None:
        super().__init__(batch_size, seed)
        for reserved in _RESERVED:
            if reserved in options:
                raise ValueError(f"{reserved}= is decided by resumable (it batches the stream); leave it out of the "
                                 f"loader options")
        if iter(dataset) is dataset:
            raise TypeError(f"data is an iterator ({type(dataset).__name__}), which can be read only once: pass an "
                            f"IterableDataset (or any object) whose __iter__ starts the data afresh, so that each "
                            f"epoch and each resume can read it")
        if options.pop("persistent_workers", False):
            log.info("persistent_workers is not used with iterable data: each epoch starts its workers at the "
                     "epoch's position")
        self.dataset = dataset
        self.drop_last = drop_last
        self.collate = options.pop("collate_fn", None) or default_collate
        self.options = options
        self.workers = max(int(options.get("num_workers", 0)), 1)
        self.protocol = has_protocol(dataset)
        refilled = refilled_on_load(dataset) if self.protocol else None
        if refilled is not None:  # its state would resume somewhere else: replayed instead, which is exact
            self.protocol = False
            log.info(f"the data is resumed by replaying its epoch up to the saved position, not by its "
                     f"state_dict(): {refilled}. For an O(1) resume shuffle without a buffer (e.g. shuffle the "
                     f"files per epoch yourself) or load the data map-style (not streaming)")
        self.owns_loader = True

    def identity(self) -> dict[str, Any]:
        return {"kind": "dataset stream", "batch_size": self.batch_size, "seed": self.seed, "drop_last": self.drop_last,
                "num_workers": int(self.options.get("num_workers", 0)), "protocol": self.protocol}

    def _fresh(self, position: dict[str, Any] | None) -> dict[str, Any]:
        if position is not None:
            return {"workers": copy.deepcopy(position["workers"]), "next": position["next"]}
        return {"workers": [{"count": 0, "samples": 0, "state": None} for _ in range(self.workers)], "next": 0}

    def _consume(self, mark: Any) -> None:
        worker, count, samples, state, following = mark
        self._consumed["workers"][worker] = {"count": count, "samples": samples, "state": state}
        self._consumed["next"] = following

    def _open(self, epoch: int, first: int, position: dict[str, Any] | None) -> Iterator[tuple[Any, int, Any]]:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        start = self._consumed["workers"]
        generator = torch.Generator()
        generator.manual_seed(epoch_seed(self.seed ^ 0x57EA, epoch))
        stream = _WorkerStream(self.dataset, self.batch_size, self.collate, self.drop_last, self.protocol,
                               self.seed, epoch, copy.deepcopy(start))
        self._iterator = iterator = iter(DataLoader(stream, batch_size=None, generator=generator,
                                                    **worker_options(self.options)))
        replay = 0 if self.protocol else sum(w["count"] for w in start)
        began = time.perf_counter()
        queues: list[deque] = [deque() for _ in range(self.workers)]
        ended = [False] * self.workers
        worker = self._consumed["next"]
        while not all(ended):
            if ended[worker]:
                worker = (worker + 1) % self.workers
                continue
            while not queues[worker]:
                item = next(iterator, None)
                if item is None:  # every worker is done (one that died raises in the DataLoader)
                    return
                queues[item[1]].append(item)
            batch, _, count, size, samples, state = queues[worker].popleft()
            if size == _FAILED:
                raise ResumeNotApplied(_not_loaded_message(f"{type(self.dataset).__name__}, worker {worker}", *state))
            if size == _END:
                ended[worker] = True
                continue
            if replay:
                self._replayed(replay, sum(w["samples"] for w in start), time.perf_counter() - began,
                               "the dataset has no state_dict()/load_state_dict(): give it those (a Hugging Face "
                               "datasets IterableDataset has them) to resume in O(1)")
                replay = 0
            following = (worker + 1) % self.workers
            yield batch, size, (worker, count, samples, state, following)
            worker = following


class LoaderStream(_Stream):
    """A loader iterated as it is: torchdata's ``StatefulDataLoader`` (O(1) resume), or a plain ``DataLoader``
    (resumed by replay)."""

    def __init__(self, loader: Any, batch_size: int, seed: int) -> None:
        super().__init__(batch_size, seed)
        size = getattr(loader, "batch_size", None)
        if size is not None and size != batch_size:
            raise ValueError(f"batch_size={batch_size} but the loader makes batches of {size}: pass the same value")
        self.loader = loader
        self.protocol = has_protocol(loader)
        refilled = refilled_on_load(getattr(loader, "dataset", None)) if self.protocol else None
        if refilled is not None:  # the loader's state holds its dataset's, which would resume somewhere else
            self.protocol = False
            log.info(f"the loader is resumed by replaying its epoch up to the saved position, not by its "
                     f"state_dict(): its dataset's {refilled}")

    def _not_loaded(self, error: BaseException) -> ResumeNotApplied:
        return ResumeNotApplied(_not_loaded_message(type(self.loader).__name__, type(error).__name__, str(error)))

    def identity(self) -> dict[str, Any]:
        return {"kind": "loader stream", "batch_size": self.batch_size, "protocol": self.protocol,
                "num_workers": int(getattr(self.loader, "num_workers", 0) or 0)}

    def _fresh(self, position: dict[str, Any] | None) -> dict[str, Any]:
        return {"loader": position.get("loader") if position is not None else None}

    def _consume(self, mark: Any) -> None:
        self._consumed["loader"] = mark

    def _open(self, epoch: int, first: int, position: dict[str, Any] | None) -> Iterator[tuple[Any, int, Any]]:
        dataset = getattr(self.loader, "dataset", None)
        for holder in (self.loader, dataset):
            if hasattr(holder, "set_epoch"):
                holder.set_epoch(epoch)
        loaded = self.protocol and position is not None and position.get("loader") is not None
        if loaded:
            try:  # also at an epoch boundary: its next iter() is a new epoch
                self.loader.load_state_dict(position["loader"])
            except Exception as e:  # noqa: BLE001 - named as what it is: the saved position did not load
                raise self._not_loaded(e) from e
        self._iterator = iterator = iter(self.loader)
        if loaded:  # a loader's workers load their dataset's state when the first batch is asked for
            try:
                ahead = next(iterator)
            except StopIteration:
                ahead = None
            except Exception as e:  # noqa: BLE001
                raise self._not_loaded(e) from e
            if ahead is not None:
                iterator = itertools.chain([ahead], iterator)
        if not self.protocol and first:
            began, samples = time.perf_counter(), 0
            for _ in range(first):
                samples += batch_size_of(next(iterator))
            self._replayed(first, samples, time.perf_counter() - began,
                           "the loader has no state_dict()/load_state_dict(): use torchdata's StatefulDataLoader "
                           "(or pass the dataset itself) to resume in O(1)")
        for batch in iterator:
            size = batch_size_of(batch)
            yield batch, size, (self.loader.state_dict() if self.protocol else None)
        yield None, _END, (self.loader.state_dict() if self.protocol else None)


def _not_loaded_message(what: str, kind: str, text: str) -> str:
    lines = text.strip().splitlines() or [""]
    detail = lines[-1] if "Traceback" in text else f"{kind}: {lines[0]}"  # a worker's error ends with the original
    return (f"the data ({what}) could not resume at its saved position ({detail}): its "
            f"load_state_dict() does not accept what its state_dict() gave. Fix its state_dict()/load_state_dict(), "
            f"or remove them so that it is resumed by replay; the checkpoint is unchanged")


def stream_source(data: Any, batch_size: int, seed: int, drop_last: bool, loader_options: dict[str, Any]) -> _Stream:
    """The stream for ``Run(data=...)``: a loader as it is, a dataset through workers."""
    if is_loader(data):
        given = sorted(k for k, v in loader_options.items() if v not in (None, 0, False))
        if given:
            raise ValueError(f"data is a loader, so {', '.join(given)} belong to it: set them where the loader is "
                             f"made and leave them out of Run(...)")
        return LoaderStream(data, batch_size, seed)
    return DatasetStream(data, batch_size, seed, drop_last, **loader_options)
