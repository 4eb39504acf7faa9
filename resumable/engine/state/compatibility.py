"""Checks of a checkpoint against this run before a resume: it was written for the same computation. (That every
commit loads back safely is checked as it is written: checkpoint/format.py loadable_bytes.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import ConfigMismatch


def check_computation(saved: dict[str, Any], current: dict[str, Any], run_dir: str, api: bool,
                      ignore: frozenset[str] = frozenset(),
                      accept: Mapping[str, tuple[Any, Any]] | None = None) -> None:
    """Raise ConfigMismatch for the first field that differs; ``accept`` maps a field to the one change
    ``(checkpoint's, now)`` allowed on purpose (the bf16 -> fp16 switch of ``--amp auto``)."""
    for key in sorted((set(saved) | set(current)) - ignore):
        default = "none" if key == "amp" else None  # checkpoints from before --amp existed
        change = (saved.get(key, default), current.get(key, default))
        if accept and key in accept and change == tuple(accept[key]):
            continue
        if change[0] != change[1]:
            raise ConfigMismatch(key, saved.get(key, default), current.get(key, default), run_dir, api=api)
