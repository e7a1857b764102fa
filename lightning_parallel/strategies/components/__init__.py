"""Each parallelism the engine runs, as a component with one small interface (see :class:`Component`).

The engine holds one of each and calls them in a fixed order — tensor, pipeline, activation
checkpointing, compile, context (sequence split, ring attention), placement (this rank's part onto
its device), data — as torchtitan applies ``apply_tp`` → ``apply_ac`` → ``apply_fsdp``. A new dimension is
one more axis in :mod:`lightning_parallel.layout` plus one component here (expert parallelism borrows the
data-parallel axis instead of adding one).
"""

from lightning_parallel.strategies.components.base import Component
from lightning_parallel.strategies.components.checkpointing import (
    ActivationCheckpointingComponent,
)
from lightning_parallel.strategies.components.compile import CompileComponent
from lightning_parallel.strategies.components.context import ContextParallelComponent
from lightning_parallel.strategies.components.data import DataParallelComponent
from lightning_parallel.strategies.components.expert import ExpertParallelComponent
from lightning_parallel.strategies.components.nonfinite import (
    NONFINITE_MODES,
    NonFiniteGuard,
)
from lightning_parallel.strategies.components.pipeline.component import PipelineComponent
from lightning_parallel.strategies.components.placement import ModelPlacement
from lightning_parallel.strategies.components.progress import ProgressReport
from lightning_parallel.strategies.components.tensor import TensorParallelComponent

__all__ = [
    "NONFINITE_MODES",
    "ActivationCheckpointingComponent",
    "CompileComponent",
    "Component",
    "ContextParallelComponent",
    "DataParallelComponent",
    "ExpertParallelComponent",
    "ModelPlacement",
    "NonFiniteGuard",
    "PipelineComponent",
    "ProgressReport",
    "TensorParallelComponent",
]
