"""Checks of a checkpoint against this run before a resume: it was written for the same computation, compared as
JSON gives it back (:func:`json_value`). (That every commit loads back safely is checked as it is written:
checkpoint/format.py loadable_bytes.)"""

from __future__ import annotations

import json
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


def json_value(value: Any, where: str) -> Any:
    """``value`` as it comes back from JSON (tuples become lists, keys strings), so what is compared on resume
    is what was recorded; a value JSON cannot encode is refused now, naming where it is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise ValueError(f"{where} has a key {key!r} of type {type(key).__name__}; JSON keys are strings "
                                 f"(use str keys)")
            out[json.loads(json.dumps({key: None})).popitem()[0]] = json_value(item, f"{where}[{key!r}]")
        return out
    raise ValueError(f"{where} is a {type(value).__name__} ({value!r}), which JSON cannot record; pass a plain "
                     f"value instead (e.g. str({value!r}))")
