"""Command-line entry points: ``resumable-train`` (train.py) and the ``resumable`` command group (commands.py); the
one place errors become exit codes (exits.py)."""

from .commands import checkpoint_status, main
from .train import train_command

__all__ = ["checkpoint_status", "main", "train_command"]
