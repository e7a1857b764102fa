"""The strategy engine: Lightning glue that runs an unmodified LightningModule under a ParallelLayout.

One engine owns launch, the process group, the ``(pp, dp, tp)`` mesh, the sampler arguments, collectives
over the right group, and the wrapping of the module. The named strategies (``DataParallelStrategy``
and those that follow) are thin presets of it, so every layout shares the same glue.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.overrides.distributed import (
    _sync_module_states,
    prepare_for_backward,
)
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import _augment_message
from lightning.pytorch.utilities.rank_zero import (
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_parallel.checkpoint.files import CheckpointFormat
from lightning_parallel.checkpoint.io import ParallelCheckpointIO
from lightning_parallel.checkpoint.replica_sampler import split_custom_sampler
from lightning_parallel.layout import (
    ParallelLayout,
    RankCoordinates,
    data_parallel_mesh,
)
from lightning_parallel.measure.comm import CommStats
from lightning_parallel.parallelize.batchnorm import (
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from lightning_parallel.parallelize.checkpointing import (
    normalize_patterns,
)
from lightning_parallel.parallelize.data import DataParallelConfig
from lightning_parallel.parallelize.grad_norm import clip_optimizer_grad_norm
from lightning_parallel.parallelize.periodic_sync import PeriodicSync, SyncConfig
from lightning_parallel.parallelize.pipeline import PipelineConfig
from lightning_parallel.parallelize.sequence import reduce_partial_gradients
from lightning_parallel.parallelize.tensor import (
    TensorParallelConfig,
    apply_tensor_parallel,
    check_plan,
)
from lightning_parallel.plan.layouts import Layout
from lightning_parallel.strategies.checkpoint_files import (
    SAVE_FORMATS,
    CheckpointFilesMixin,
)
from lightning_parallel.strategies.collectives import GroupCollectivesMixin, whole
from lightning_parallel.strategies.data_steps import DataParallelStepsMixin
from lightning_parallel.strategies.launch import (
    START_METHODS,
    StartMethod,
    make_launcher,
)
from lightning_parallel.strategies.options import (
    check_known,
    configs_options,
    preset_signature,
    split_options,
)
from lightning_parallel.strategies.pipeline_runner import PipelineRunner
from lightning_parallel.strategies.pipeline_steps import PipelineStepsMixin
from lightning_parallel.strategies.whole_state import WholeTensorCheckpointMixin

log = logging.getLogger(__name__)

#: Process-group timeout when none is given: long enough for slow first steps, short enough to not hang a job.
DEFAULT_TIMEOUT_S = 1800.0


class ParallelEngineStrategy(
    PipelineStepsMixin,
    DataParallelStepsMixin,
    GroupCollectivesMixin,
    CheckpointFilesMixin,
    WholeTensorCheckpointMixin,
    ParallelStrategy,
):
    """Runs a LightningModule on a ``(pp, dp, tp)`` DeviceMesh.

    Transforms apply in a fixed order: the tensor-parallel plan (resolved on the whole module) → the
    pipeline split (with ``pp > 1``, on the first batch; each stage's parameters then placed on the ``tp``
    mesh by the plan) → activation checkpointing → data parallelism over ``dp`` (replicate: DDP, or for
    DTensor parameters FSDP2 with shards of one rank; shard / hybrid_shard: FSDP2; pipeline stages
    average gradients once per optimizer step). Use a named preset such as
    :class:`~lightning_parallel.strategies.hybrid.HybridParallelStrategy` rather than this class directly.

    Args:
        layout: Parallel sizes; ``-1`` in one of them fills the remaining ranks.
        data_parallel: ``data_parallel_mode`` (replicate / shard / hybrid_shard), FSDP2 resharding, DDP options
            and the gradient communication hook.
        tensor_parallel: The tensor-parallel plan (used when ``tensor_parallel_size > 1``).
        pipeline: Schedule, micro-batches and split (used when ``pipeline_parallel_size > 1``).
        activation_checkpointing: ``"auto"`` (each layer of the model's trunk), module-name glob patterns
            (relative to the LightningModule), or ``None``/``[]`` (off).
        periodic_sync: How often replicas synchronize (default every step, exact); local SGD and DiLoCo
            need replicated data parallelism without tp or pp.
        sync_batchnorm: Compute BatchNorm statistics over the whole data-parallel batch (as
            ``Trainer(sync_batchnorm=True)`` does; either switch turns it on).
        track_communication: Count the gradient buckets DDP sends (see :attr:`comm_stats`). Costs one
            Python call per bucket; switch off to use DDP's built-in C++ all-reduce.
        start_method: ``"popen"`` re-runs the script per rank (scripts, Hydra); ``"spawn"``/``"fork"``
            start workers from a running interpreter (notebooks, tests). torchrun and SLURM are detected
            through Lightning's cluster environments and need no option.
        process_group_backend: ``"nccl"``/``"gloo"``; ``None`` picks nccl on CUDA and gloo on CPU.
        timeout: Seconds (or a ``timedelta``) a collective may wait before the job fails instead of hanging.
        save_format: ``"sharded"``: each rank writes its own shards (a directory, through
            ``torch.distributed.checkpoint``); ``"full"``: whole tensors in one file that loads into the plain
            module. Any layout resumes from either. Checkpoints appear under their name only when complete.
        async_save: Write checkpoints in the background while training goes on (tensors are copied to host
            memory first); each save is completed before the next one, before a load and at the end.
        checkpoint_io: Defaults to :class:`~lightning_parallel.checkpoint.io.ParallelCheckpointIO` (atomic files).
    """

    #: Presets: engine argument -> config dataclass whose fields they take as flat keywords (see options.py).
    preset_configs: ClassVar[dict[str, type]] = {}
    #: Presets: a flat keyword's default where the preset deliberately differs from the dataclass's.
    preset_defaults: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.preset_configs:
            # help(DataParallelStrategy) and IDEs show every option with the default that applies.
            leading = [p for p in inspect.signature(cls.__init__).parameters.values()
                       if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
            cls.__signature__ = preset_signature(
                leading, cls.preset_configs, cls.preset_defaults, ParallelEngineStrategy.__init__, _CONFIG_ARGUMENTS
            )

    @classmethod
    def preset_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """A preset's flat keywords as the engine's arguments: one config per component, the rest as given.

        Raises:
            TypeError: A keyword that neither the preset's components nor the engine take.
        """
        options = dict(options)
        configs = split_options(options, cls.preset_configs, cls.preset_defaults)
        accepted = [*configs_options(cls.preset_configs), *_engine_options()]
        check_known(cls.__name__, options, accepted)
        return {**configs, **options}

    def __init__(
        self,
        layout: ParallelLayout | None = None,
        *,
        data_parallel: DataParallelConfig | None = None,
        tensor_parallel: TensorParallelConfig | None = None,
        pipeline: PipelineConfig | None = None,
        activation_checkpointing: str | Sequence[str] | None = None,
        periodic_sync: SyncConfig | None = None,
        sync_batchnorm: bool = False,
        track_communication: bool = True,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT_S,
        save_format: CheckpointFormat = "sharded",
        async_save: bool = False,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else ParallelCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        if save_format not in SAVE_FORMATS:
            raise ValueError(f"save_format={save_format!r} is unknown; choose one of {', '.join(SAVE_FORMATS)}.")
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be True or False, got {async_save!r}.")
        self._save_format = save_format
        self._async_save = async_save
        layout = layout if layout is not None else ParallelLayout()
        if not isinstance(layout, ParallelLayout):
            raise TypeError(f"layout must be a ParallelLayout, got {type(layout).__name__}.")
        if pipeline is not None and not isinstance(pipeline, PipelineConfig):
            raise TypeError(f"pipeline must be a PipelineConfig, got {type(pipeline).__name__}.")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is unknown; choose one of {', '.join(START_METHODS)}.")
        self._timeout = _as_timedelta(timeout)
        self._requested_layout = layout
        self._layout: ParallelLayout | None = None
        self._data_parallel = data_parallel if data_parallel is not None else DataParallelConfig()
        self._tensor_parallel = tensor_parallel if tensor_parallel is not None else TensorParallelConfig()
        self._tensor_parallel_module: nn.Module | None = None
        self._pipeline = pipeline if pipeline is not None else PipelineConfig()
        self._activation_checkpointing = normalize_patterns(activation_checkpointing)
        self._sync = periodic_sync if periodic_sync is not None else SyncConfig()
        if not isinstance(self._sync, SyncConfig):
            raise TypeError(f"periodic_sync must be a SyncConfig, got {type(self._sync).__name__}.")
        self._periodic_sync: PeriodicSync | None = None
        self._checkpointed: list[str] | None = None
        self._pipeline_runner: PipelineRunner | None = None
        self._pending_gradients: list[tuple[nn.Parameter, Tensor]] = []
        self._sharded_units: list[nn.Module] = []
        self._accumulating = False
        self._loss_parallel = False
        self._sync_batchnorm = sync_batchnorm
        self._batchnorm_converted = False
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._mesh: DeviceMesh | None = None
        self._comm_stats: CommStats | None = CommStats() if track_communication else None
        self._forward_redirection = _DDPForwardRedirection()

    # ------------------------------------------------------------------ properties

    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError("The strategy has no devices yet; it is connected to them by the Trainer.")
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Whether more than one process takes part."""
        return self.num_nodes * self.num_processes > 1

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def layout(self) -> ParallelLayout:
        """The resolved layout (known once the Trainer has connected the devices)."""
        if self._layout is None:
            raise RuntimeError("The layout is resolved when the Trainer is created; pass this strategy to a Trainer first.")
        return self._layout

    @property
    def coordinates(self) -> RankCoordinates:
        """This rank's ``(pp, dp, tp)`` coordinates."""
        return self.layout.coordinates(self.global_rank)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(pp, dp, tp)`` DeviceMesh (exists after the process group is set up)."""
        if self._mesh is None:
            raise RuntimeError("The device mesh is created in setup_environment(); it is not available yet.")
        return self._mesh

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """Process group of this rank's data-parallel replicas (``None`` before the mesh exists)."""
        return data_parallel_mesh(self._mesh).get_group() if self._mesh is not None else None

    @property
    def tensor_parallel_group(self) -> dist.ProcessGroup | None:
        """Process group of the ranks that split each layer (``None`` before the mesh exists)."""
        return self._mesh["tp"].get_group() if self._mesh is not None else None

    @property
    def tensor_parallel_config(self) -> TensorParallelConfig:
        """The tensor-parallel plan and options (used when ``tensor_parallel_size > 1``)."""
        return self._tensor_parallel

    def planned_layout(self, layout: ParallelLayout | None = None) -> Layout:
        """A layout (by default this strategy's resolved one) in the planner's terms: sizes, data-parallel
        mode, schedule, checkpointing."""
        layout = layout if layout is not None else self.layout
        pipelined = layout.pipeline_parallel_size > 1
        mode = self._data_parallel.mode if layout.data_parallel_size > 1 else "replicate"
        shard_size = layout.data_parallel_shard_size
        return Layout(
            dp=layout.data_parallel_size,
            tp=layout.tensor_parallel_size,
            pp=layout.pipeline_parallel_size,
            data_parallel_mode=mode,
            shard_size=shard_size,
            schedule=self._pipeline.schedule if pipelined else "none",
            stages_per_rank=self._pipeline.stages_per_rank if pipelined else 1,
            microbatches=self._pipeline.microbatches if pipelined else 1,
            activation_checkpointing=bool(self._activation_checkpointing),
        )

    @property
    def comm_stats(self) -> CommStats | None:
        """Gradient communication counted so far on this rank (``None`` if tracking is off)."""
        return self._comm_stats

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Replicas see different data; tensor- and pipeline-parallel peers must see the same batch.
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.coordinates.dp}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Lightning's wrapper around a custom sampler hides that sampler's state: split it in lockstep
        # instead, so that a checkpoint resumes the same order (under any data-parallel size).
        return split_custom_sampler(dataloader)

    # ------------------------------------------------------------------ launch and process groups

    @override
    def _configure_launcher(self) -> None:
        if self.cluster_environment is None:
            raise RuntimeError("The Trainer must connect a cluster environment before the launcher is configured.")
        # Validate here, in the launching process, so a bad layout fails once and before any process starts.
        self._resolve_layout(
            self.num_nodes * self.num_processes,
            f"trainer devices={self.num_processes} × num_nodes={self.num_nodes}",
        )
        self._check_pipeline_layout(self._layout)
        self._check_data_parallel_layout(self._layout)
        self._launcher = make_launcher(self, self._start_method, self.cluster_environment)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        self._data_parallel.check_backend(self._process_group_backend)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        layout = self._resolve_layout(dist.get_world_size(), "processes in the default process group")
        self._mesh = layout.build_mesh(self.root_device.type)
        expected = layout.axis_coordinates(self.global_rank)
        found = {axis: self._mesh[axis].get_local_rank() for axis in expected}
        if found != expected:
            # The sampler and the collectives rely on the layout's rank arithmetic matching the mesh.
            raise RuntimeError(
                f"Rank {self.global_rank}: mesh coordinates {found} differ from the layout's {expected}; the "
                "process group's ranks are not numbered as the launcher assigned them."
            )
        rank_zero_info(f"lightning_parallel: layout {self._layout.describe()} on {self._process_group_backend}")

    def _resolve_layout(self, world_size: int, world_description: str) -> ParallelLayout:
        self._layout = self.layout_for(world_size, self.num_processes, world_description)
        return self._layout

    def layout_for(self, world_size: int, devices_per_node: int, world_description: str | None = None) -> ParallelLayout:
        """The layout this strategy runs over ``world_size`` ranks, its data-parallel ranks split into replicas
        and shards as the data-parallel mode says (no process group needed: the planner asks too).

        Raises:
            ValueError: The sizes do not fit ``world_size``, or the shard size does not divide the replicas.
        """
        layout = self._requested_layout.resolve(world_size, world_description=world_description)
        shard = self._data_parallel.shard_size_for(layout.data_parallel_size, layout.tensor_parallel_size, devices_per_node)
        return layout.with_data_parallel_shard_size(shard)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ model setup

    @override
    def setup(self, trainer: Trainer) -> None:
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and (self._sync_batchnorm or self._layer_sync is not None):
            self.model = convert_sync_batchnorm(self.model, self.data_parallel_group, self.root_device.type)
            self._batchnorm_converted = True
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._is_pipelined:
            self._setup_pipelined(trainer, fitting)
            self.load_deferred_model_state()
            return
        self._apply_tensor_parallel()
        self._apply_activation_checkpointing()
        if fitting:
            self._check_manual_optimization_support()
            self._data_parallel.check_accumulation(trainer.accumulate_grad_batches)
            self._apply_data_parallel()
            self.setup_optimizers(trainer)
        elif self._is_sharded:
            self._apply_data_parallel()
        else:
            # No DDP wrapper outside fitting: make sure every rank evaluates the same weights.
            _sync_module_states(self.model)
        self._reduce_metrics_over_data_parallel()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self._is_sharded:
            # Lightning clips through the precision plugin with torch's clip_grad_norm_, which refuses the
            # mix of DTensor and plain gradients that TP leaves; give this plugin the mesh-aware version.
            self.precision_plugin.clip_grad_by_norm = clip_optimizer_grad_norm
        self.load_deferred_model_state()

    def _apply_tensor_parallel(self) -> None:
        module = self.lightning_module
        # fit() then validate()/test() set up again: the module is already split (and stays split).
        if self.layout.tensor_parallel_size == 1 or module is self._tensor_parallel_module:
            return
        resolved = self._tensor_parallel.resolve(module, warn=rank_zero_warn)
        check_plan(module, resolved, self.layout.tensor_parallel_size)
        # Neither TP (outside the split layers) nor FSDP2 copies weights between ranks: start every rank
        # from rank 0's weights, as DDP would, even if the module was not built from one seed everywhere.
        _sync_module_states(module)
        apply_tensor_parallel(module, self.device_mesh["tp"], resolved, self._tensor_parallel.sequence_parallel)
        self._tensor_parallel_module = module
        if "loss_parallel" in resolved.styles.values():
            self._loss_parallel = True
            _log_whole_values(module)
        sequence = " with sequence parallelism" if self._tensor_parallel.sequence_parallel else ""
        rank_zero_info(
            f"lightning_parallel: tensor-parallel plan over tp={self.layout.tensor_parallel_size}{sequence}:\n"
            f"{resolved.describe()}"
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._is_pipelined:
            return self._pipeline_step("training_step", args, kwargs)
        # Under a loss_parallel head, F.cross_entropy on vocabulary-sharded logits must run (and be
        # differentiated) inside torch's loss_parallel(); what the step returns becomes ordinary tensors.
        if not self._loss_parallel:
            return super().training_step(*args, **kwargs)
        with loss_parallel():
            return apply_to_collection(super().training_step(*args, **kwargs), DTensor, whole)

    @override
    def backward(self, closure_loss: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self._is_pipelined:
            # The schedule ran backward inside training_step, micro-batch by micro-batch.
            self._deliver_pipeline_gradients()
            return closure_loss
        with loss_parallel() if self._loss_parallel else nullcontext():
            return super().backward(closure_loss, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # After the last micro-batch only: sequence-parallel norms leave partial-sum gradients.
        if self._is_sharded and not self._accumulating:
            reduce_partial_gradients(self.lightning_module.parameters())

    def _check_manual_optimization_support(self) -> None:
        if self._data_parallel.static_graph and not self.lightning_module.automatic_optimization:
            raise ValueError(
                "static_graph=True is not supported with manual optimization (automatic_optimization=False): "
                "Lightning cannot tell DDP when the first static-graph iteration ends. Set static_graph=False."
            )

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        # With manual optimization Lightning does not go through DDP's forward bookkeeping for backward.
        if isinstance(self.model, DistributedDataParallel) and not self.lightning_module.automatic_optimization:
            prepare_for_backward(self.model, closure_loss)

    # ------------------------------------------------------------------ errors and teardown

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._loss_parallel:
            _augment_message(
                exception,
                pattern=".*mixed torch.Tensor and DTensor.*",
                new_message=(
                    "The output head uses the 'loss_parallel' style: in training_step its output is a DTensor "
                    "sharded over the vocabulary and may only be passed to F.cross_entropy. Compute anything else "
                    "from the logits in validation_step, or give the head the 'colwise' or 'replicate' style."
                ),
            )
        _augment_message(
            exception,
            pattern=".*Expected to have finished reduction in the prior iteration.*",
            new_message=(
                "Your LightningModule has parameters that did not take part in the loss returned by training_step. "
                "If that is intended, pass find_unused_parameters=True to the strategy "
                "(on the command line: strategy.find_unused_parameters=true)."
            ),
        )

    @override
    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        if self._batchnorm_converted and self.model is not None:
            self.model = revert_sync_batchnorm(self.model)
            self._batchnorm_converted = False
        failure = sys.exc_info()[1]  # Lightning tears down inside its handler when the run failed
        try:
            super().teardown()
        except RuntimeError as error:
            # Lightning moves the module to the CPU; DTensor parameters that a failed step's autograd graph
            # still references cannot be swapped. Let the failure that ended the run surface, not this.
            if failure is None or "Couldn't swap" not in str(error):
                raise
            log.debug("teardown after a failure could not move DTensor parameters: %s", error)

    @classmethod
    def register_as(cls, registry: Any, name: str, description: str, **init_params: Any) -> None:
        """Register ``cls`` under ``name`` in a Lightning strategy registry, once."""
        if name not in registry:
            registry.register(name, cls, description=description, **init_params)


def _log_whole_values(module: LightningModule) -> None:
    """Make ``module.log`` turn DTensor values (a loss_parallel loss) into ordinary tensors first."""
    original = module.log

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        original(name, apply_to_collection(value, DTensor, whole), *args, **kwargs)

    # An instance attribute: the class, and log_dict (which calls self.log), stay as they are.
    module.log = log


#: Engine arguments that presets fill from their flat options (never passed by users of a preset).
_CONFIG_ARGUMENTS = {"layout", "data_parallel", "tensor_parallel", "pipeline", "periodic_sync"}


def _engine_options() -> list[str]:
    """The engine's own keyword arguments that a preset passes through (launch, checkpoints, devices, ...)."""
    parameters = inspect.signature(ParallelEngineStrategy.__init__).parameters
    return [name for name in parameters if name != "self" and name not in _CONFIG_ARGUMENTS]


def _as_timedelta(timeout: float | timedelta) -> timedelta:
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds (a number) or a datetime.timedelta, got {type(timeout).__name__}.")
    if seconds <= 0:
        raise ValueError(f"timeout={seconds}s must be positive: it is how long a collective may wait before failing.")
    return timedelta(seconds=seconds)


