"""Checkpoint format, commit protocol, validation and retention."""

from .format import FORMAT_VERSION, InvalidCheckpoint, UnsafeCheckpoint, fingerprint
from .manager import CheckpointInfo, CheckpointManager, checkpoints_dir, describe_age

__all__ = ["FORMAT_VERSION", "CheckpointInfo", "CheckpointManager", "InvalidCheckpoint", "UnsafeCheckpoint",
           "checkpoints_dir", "describe_age", "fingerprint"]
