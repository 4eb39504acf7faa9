"""What `resumable chaos` kills and restarts: `resumable-train`, a Python function or script, or a command."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .forkserver import TRAIN_TARGET

RUN_DIR = "{run_dir}"  # replaced by the scratch run dir in a target's arguments
FORMS = "resumable-train, MODULE:FUNCTION, FILE.py:FUNCTION, FILE.py or command"


@dataclass(frozen=True)
class Target:
    """What chaos kills and restarts: ``name`` is ``resumable-train``, ``command`` (``args`` is the whole
    command line) or a Python target (``MODULE:FUNCTION``, ``FILE.py:FUNCTION``, ``FILE.py``; see
    :mod:`.forkserver`). ``{run_dir}`` in ``args`` becomes the run dir; `resumable-train` without it gets
    ``--run-dir``; in a gdrive:// URL, ``{run_dir}`` is ``<workdir name>/<scratch run's name>``.

    >>> Target.parse("mypkg.train:main", ["--run-dir", "{run_dir}", "--epochs", "2"]).kind
    'python'
    """

    name: str
    args: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        return self.name if self.name in ("resumable-train", "command") else "python"

    @property
    def python(self) -> str:
        """The fork server's target (what the child calls); not for commands."""
        assert self.kind != "command", "a command is not a Python target"
        return TRAIN_TARGET if self.kind == "resumable-train" else self.name

    @classmethod
    def parse(cls, name: str, args: Sequence[str]) -> Target:
        """Validate; ``ValueError`` naming the fix. A file target's path becomes absolute."""
        args, given = tuple(args), name
        placed = any(RUN_DIR in a for a in args)
        if name == "resumable-train":
            if not placed and any(a == "--run-dir" or a.startswith("--run-dir=") for a in args):
                raise ValueError("chaos chooses the run dirs itself; leave --run-dir out of the training options "
                                 f"(or write --run-dir {RUN_DIR})")
            return cls(name, args)
        if name == "command":
            if not args:
                raise ValueError("--target command runs what follows -- as a command line, and nothing does; "
                                 f"e.g. -- python train.py --run-dir {RUN_DIR}")
        elif ":" in name or name.endswith(".py"):
            where, _, function = name.rpartition(":") if ":" in name else (name, "", "")
            if ":" in name and not all(part.isidentifier() for part in function.split(".")):
                raise ValueError(f"--target {name!r}: {function!r} after the colon is not a function name")
            if where.endswith(".py") or os.sep in where:
                if not Path(where).is_file():
                    raise ValueError(f"--target {name!r}: there is no file {where!r} (relative to {os.getcwd()})")
                name = str(Path(where).resolve()) + (f":{function}" if function else "")
            elif not all(part.isidentifier() for part in where.split(".")):
                raise ValueError(f"--target {name!r}: {where!r} is not a module name")
        else:
            raise ValueError(f"--target {name!r} is not one of {FORMS}")
        if not placed:
            raise ValueError(f"--target {given}: write {RUN_DIR} in its arguments where the run dir goes (e.g. "
                             f"-- ... --run-dir {RUN_DIR}); chaos runs it in two scratch run dirs")
        return cls(name, args)

    def arguments(self, run_dir: Path, log_every_step: bool) -> list[str]:
        """The argument list (a whole command line for ``command``) of one session in ``run_dir``."""
        args = [a.replace(RUN_DIR, _drive_name(run_dir) if "gdrive://" in a else str(run_dir)) for a in self.args]
        if self.kind != "resumable-train":
            return args
        run = [] if any(RUN_DIR in a for a in self.args) else ["--run-dir", str(run_dir)]
        return [*args, *(["--log-every", "1"] if log_every_step else []), *run, "--no-progress"]


def _drive_name(run_dir: Path) -> str:
    """``{run_dir}`` in a gdrive:// URL: the scratch run's folder names (a Drive path has no absolute form)."""
    return f"{run_dir.parent.name}/{run_dir.name}"
