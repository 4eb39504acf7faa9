"""The state-writer seam: how a checkpoint's state becomes files in its step directory, and back.

The manager owns the commit protocol (step directory, manifest written last, retention); a
:class:`StateFormat` only writes the payload files of one state into a directory and reads them back.
Format 1 is :class:`TorchFile`: one ``state.pt`` (``torch.save`` of plain containers and tensors, loaded
with ``weights_only=True`` and memory-mapped, so N ranks reading one checkpoint share its pages). A sharded
safetensors format, or a ``torch.distributed.checkpoint`` writer, plugs in here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from . import format as fmt


class StateFormat(Protocol):
    name: str

    def write(self, directory: Path, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Write ``state`` into ``directory``; returns ``{file name: {"size", "sha256"}}`` of every file."""
        ...

    def read(self, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """The state written by :meth:`write` (raises InvalidCheckpoint when it cannot be read safely)."""
        ...


class TorchFile:
    """Format 1: the whole state in one ``state.pt``."""

    name = "torch-file"

    def write(self, directory: Path, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {fmt.PAYLOAD: fmt.write_payload(directory, state)}

    def read(self, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        payload = fmt.load_payload(directory / fmt.PAYLOAD)
        if not isinstance(payload, dict):
            raise fmt.InvalidCheckpoint(f"{directory} holds a {type(payload).__name__}, not a checkpoint")
        return payload
