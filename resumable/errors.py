"""User-facing errors. Each message names the cause and the fix; the CLI turns them into exit code 2."""

from __future__ import annotations

from typing import Any


class ResumableError(Exception):
    """A problem the user can fix by changing how the run is started."""


class ConfigMismatch(ResumableError):
    def __init__(self, field: str, old: Any, new: Any, run_dir: str) -> None:
        self.field, self.old, self.new = field, old, new
        super().__init__(
            f"{field} differs from the checkpoint in {run_dir}: checkpoint {old!r}, now {new!r}. Resuming "
            f"needs the same value (omit the option to reuse the checkpoint's), or start over with "
            f"--fresh --overwrite, or use another --run-dir.")


class NothingToResume(ResumableError):
    pass


class RunDirInUse(ResumableError):
    pass
