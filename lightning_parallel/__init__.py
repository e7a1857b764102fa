"""lightning_parallel: Lightning strategies for data, tensor, pipeline and hybrid parallelism.

Importing the package registers the strategy names with Lightning, so
``Trainer(strategy="data_parallel")`` works after ``import lightning_parallel``.
"""

from lightning_parallel.checkpoint.files import latest_checkpoint, package_version
from lightning_parallel.checkpoint.io import ParallelCheckpointIO
from lightning_parallel.layout import ParallelLayout, RankCoordinates
from lightning_parallel.measure.comm import CommStats
from lightning_parallel.observe.monitor import ScalingMonitor
from lightning_parallel.observe.summary import TrainingSummary
from lightning_parallel.parallelize.data.replicated import (
    COMM_HOOKS,
    DATA_PARALLEL_MODES,
    DataParallelConfig,
)
from lightning_parallel.parallelize.pipeline.config import PipelineConfig
from lightning_parallel.parallelize.pipeline.schedule import SCHEDULES
from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig
from lightning_parallel.parallelize.tensor.plan import STYLES
from lightning_parallel.strategies import (
    AutoParallelStrategy,
    DataParallelStrategy,
    HybridParallelStrategy,
    ParallelEngineStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)
from lightning_parallel.strategies.adapters import save_adapters
from lightning_parallel.strategies.grad_norms import grad_norm
from lightning_parallel.strategies.launch import training_job

# From the installed metadata, so pyproject.toml is the one place the version is written.
__version__ = package_version()

__all__ = [
    "AutoParallelStrategy",
    "COMM_HOOKS",
    "DATA_PARALLEL_MODES",
    "SCHEDULES",
    "STYLES",
    "CommStats",
    "DataParallelConfig",
    "DataParallelStrategy",
    "HybridParallelStrategy",
    "ParallelCheckpointIO",
    "ParallelEngineStrategy",
    "ParallelLayout",
    "PipelineConfig",
    "PipelineParallelStrategy",
    "RankCoordinates",
    "ScalingMonitor",
    "TensorParallelConfig",
    "TensorParallelStrategy",
    "TrainingSummary",
    "grad_norm",
    "latest_checkpoint",
    "save_adapters",
    "training_job",
]
