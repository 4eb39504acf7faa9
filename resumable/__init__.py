"""resumable: PyTorch training that survives being killed at any instant and resumes bit-identically."""

from .checkpoint import CheckpointManager
from .config import RunOptions, TrainConfig
from .data import IndexBatches
from .distributed import Distributed, init_distributed
from .run import Run
from .sampler import ResumableSampler
from .session import Session
from .state import Stateful, TrainState

__version__ = "0.1.0"
__all__ = ["CheckpointManager", "Distributed", "IndexBatches", "ResumableSampler", "Run", "RunOptions", "Session",
           "Stateful", "TrainConfig", "TrainState", "__version__", "init_distributed"]
