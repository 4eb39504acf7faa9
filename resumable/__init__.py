"""resumable: PyTorch training that survives being killed at any instant and resumes bit-identically."""

from .checkpoint import CheckpointManager
from .config import RunOptions, TrainConfig
from .engine.checkpointer import Checkpointer
from .engine.data import IndexBatches
from .engine.distributed import Distributed, init_distributed
from .engine.run import Run
from .engine.sampler import ResumableSampler
from .engine.state import Stateful, TrainState
from .errors import ResumableError
from .faults import Faults

__version__ = "0.1.0"
__all__ = ["CheckpointManager", "Checkpointer", "Distributed", "Faults", "IndexBatches", "ResumableError",
           "ResumableSampler", "Run", "RunOptions", "Stateful", "TrainConfig", "TrainState", "__version__",
           "init_distributed"]
