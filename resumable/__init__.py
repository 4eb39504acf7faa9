"""resumable: PyTorch training that survives being killed at any instant and resumes bit-identically."""

from .checkpoint import CheckpointManager
from .config import TrainConfig
from .sampler import ResumableSampler
from .session import Session
from .state import Stateful, TrainState

__version__ = "0.1.0"
__all__ = ["CheckpointManager", "ResumableSampler", "Session", "Stateful", "TrainConfig", "TrainState",
           "__version__"]
