"""What a component may use of the engine: the narrow interface the engine offers its parts.

Components (``strategies/components/``) and the checkpoint files and state see the engine only as an
:class:`EngineHost`, so none of them imports ``engine.py`` (which imports them all): what one part offers
another is listed here, in a view of its own (the pipeline asks the tensor-parallel part for a stage plan,
data parallelism asks the placement whether the model was built on the meta device). Adding a component
that others consult adds its view here. Structural typing: the engine and its components satisfy these
protocols without naming them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_parallel.layout import ParallelLayout, RankCoordinates
from lightning_parallel.measure.comm import CommStats
from lightning_parallel.parallelize.common.compile import CompileConfig
from lightning_parallel.parallelize.data.periodic_sync import PeriodicSync, SyncConfig
from lightning_parallel.parallelize.data.replicated import DataParallelConfig
from lightning_parallel.parallelize.pipeline.stage_tensor import StageTensorParallel
from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig


class TensorParallelView(Protocol):
    """The tensor-parallel component, as the pipeline and context parallelism see it."""

    config: TensorParallelConfig
    #: Whether the head keeps vocabulary-sharded logits (``loss_parallel``) in ``training_step``.
    loss_parallel: bool

    @property
    def enabled(self) -> bool: ...

    def stage_plan(self, root_name: str) -> StageTensorParallel: ...


class PipelineView(Protocol):
    """The pipeline component: whether it runs, and whether the model is already cut into stages."""

    @property
    def enabled(self) -> bool: ...

    @property
    def staged(self) -> bool: ...


class PipelineRunnerView(Protocol):
    """This rank's pipeline, as the checkpoint state sees it."""

    #: Every parameter's and buffer's whole shape, by name in the uncut module.
    whole_shapes: dict[str, tuple[int, ...]]


class ActivationCheckpointingView(Protocol):
    #: Which blocks recompute their activations in backward (as given, normalised).
    patterns: tuple[str, ...]


class CompileView(Protocol):
    config: CompileConfig

    @property
    def enabled(self) -> bool: ...

    def stage_compiler(self, module: nn.Module, root_name: str) -> Callable[[nn.Module], None] | None: ...


class PlacementView(Protocol):
    """Where the model's tensors are allocated: on the device, or deferred (meta) until they are sharded."""

    @property
    def deferred(self) -> bool: ...

    def place(self) -> None: ...

    def allocate_outside_stages(self) -> dict[int, Tensor]: ...

    def place_stages(self, stage_tensors: Mapping[str, Tensor], root_name: str) -> None: ...


class ExpertParallelView(Protocol):
    """Expert parallelism: the experts it divides, which data parallelism leaves alone."""

    @property
    def enabled(self) -> bool: ...

    @property
    def held_parameters(self) -> tuple[nn.Parameter, ...]: ...

    def parameter_names_under(self, root: str) -> tuple[str, ...]: ...

    def divide_stage_experts(self) -> dict[int, nn.Parameter | None]: ...


class DataParallelView(Protocol):
    config: DataParallelConfig
    sync: SyncConfig
    #: The periodic synchronisation (``None`` when gradients are averaged every step).
    periodic_sync: PeriodicSync | None

    @property
    def shards(self) -> bool: ...


class WeightAveragingView(Protocol):
    """What the pipeline tells the engine's support of Lightning's WeightAveraging."""

    def after_stages_built(self) -> None: ...


class EngineHost(Protocol):
    """The engine (:class:`~lightning_parallel.strategies.engine.ParallelEngineStrategy`) as its parts see it:
    Lightning's strategy state, the layout and mesh, and the views of the other parts."""

    # Lightning's strategy state.
    model: nn.Module | None
    precision_plugin: Precision
    optimizers: list[Optimizer]
    _layer_sync: Any

    @property
    def lightning_module(self) -> LightningModule | None: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def launcher(self) -> _Launcher | None: ...

    @property
    def checkpoint_io(self) -> CheckpointIO: ...

    @property
    def world_size(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def process_group_timeout(self) -> timedelta: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self, name: str | None = None) -> None: ...

    def model_to_device(self) -> None: ...

    # The layout and its process groups.
    layout: ParallelLayout

    @property
    def device_mesh(self) -> DeviceMesh: ...

    @property
    def coordinates(self) -> RankCoordinates: ...

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None: ...

    @property
    def replica_group(self) -> dist.ProcessGroup | None: ...

    @property
    def parameters_are_dtensors(self) -> bool: ...

    # Gradient communication counted for the monitor.
    @property
    def comm_stats(self) -> CommStats | None: ...

    def record_gradient_round(self, sent_bytes: int, seconds: float) -> None: ...

    # The other parts.
    tensor_parallel: TensorParallelView
    pipeline_parallel: PipelineView
    activation_checkpointing: ActivationCheckpointingView
    compile: CompileView
    placement: PlacementView
    expert_parallel: ExpertParallelView
    data_parallel: DataParallelView
    weight_averaging: WeightAveragingView

    @property
    def tensor_parallel_config(self) -> TensorParallelConfig: ...

    @property
    def pipeline_runner(self) -> PipelineRunnerView | None: ...
