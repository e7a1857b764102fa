"""The strategy engine: Lightning glue that runs an unmodified LightningModule under a ParallelLayout.

The engine owns launch, the process group, the mesh, the sampler arguments and collectives over the right
group; each parallelism is a component it calls at fixed points (``strategies/components``). The named
strategies (``DataParallelStrategy`` and the others) are presets of it, built from the components'
config dataclasses (``strategies/options.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, ClassVar

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.overrides.distributed import prepare_for_backward
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import _augment_message
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_parallel.checkpoint.files import CheckpointFormat
from lightning_parallel.checkpoint.replica_sampler import split_custom_sampler
from lightning_parallel.layout import ParallelLayout
from lightning_parallel.measure.comm import CommStats
from lightning_parallel.parallelize.common.compile import CompileConfig
from lightning_parallel.parallelize.data.replicated import DataParallelConfig
from lightning_parallel.parallelize.placement.deferred_init import parameters_on_meta
from lightning_parallel.parallelize.common.grad_norm import clip_optimizer_grad_norm
from lightning_parallel.parallelize.data.periodic_sync import SyncConfig
from lightning_parallel.parallelize.pipeline.config import PipelineConfig
from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig
from lightning_parallel.plan.layouts import Layout
from lightning_parallel.strategies.checkpoint_files import CheckpointFiles
from lightning_parallel.strategies.checkpoint_state import CheckpointState
from lightning_parallel.strategies.components import (
    ActivationCheckpointingComponent,
    CompileComponent,
    Component,
    ContextParallelComponent,
    DataParallelComponent,
    ExpertParallelComponent,
    ModelPlacement,
    NonFiniteGuard,
    PipelineComponent,
    ProgressReport,
    TensorParallelComponent,
)
from lightning_parallel.strategies.launch import StartMethod
from lightning_parallel.strategies.mesh_strategy import DEFAULT_TIMEOUT_S, MeshStrategy
from lightning_parallel.strategies.options import preset_options, preset_signature
from lightning_parallel.strategies.components.pipeline.runner import PipelineRunner
from lightning_parallel.strategies import grad_norms, lightning_callbacks
from lightning_parallel.strategies.weight_averaging import WeightAveragingSupport

log = logging.getLogger(__name__)

#: Engine arguments that presets fill from their flat options (never passed by users of a preset).
CONFIG_ARGUMENTS = ("layout", "data_parallel", "tensor_parallel", "pipeline", "periodic_sync", "compilation")


class ParallelEngineStrategy(MeshStrategy):
    """Runs a LightningModule on the DeviceMesh of a :class:`~lightning_parallel.layout.ParallelLayout`.

    Each parallelism is a component (:mod:`lightning_parallel.strategies.components`), run in a fixed
    order: the tensor-parallel plan (resolved on the whole module) → the pipeline (with ``pp > 1`` cut on
    the first batch; each stage then split by the plan) → activation checkpointing → data parallelism
    over ``dp`` (replicate: DDP, or for DTensor parameters FSDP2 with shards of one rank; shard /
    hybrid_shard: FSDP2; pipeline stages average gradients once per optimizer step). This class is the
    Lightning glue around them. Use a named preset such as
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
        compilation: ``compile`` (``torch.compile`` each block of the trunk, after TP and checkpointing, before
            data parallelism; in pipelines the stages' blocks), ``compile_options`` and ``compile_exclude``.
        sync_batchnorm: Compute BatchNorm statistics over the whole data-parallel batch (as
            ``Trainer(sync_batchnorm=True)`` does; either switch turns it on).
        track_communication: Count the gradient buckets DDP sends (see :attr:`comm_stats`). Costs one
            Python call per bucket; switch off to use DDP's built-in C++ all-reduce.
        nonfinite: A NaN/Inf loss or gradient on any rank: ``"error"`` stops with the step and the ranks,
            ``"skip"`` skips that optimizer step on every rank (one small all-reduce per step decides).
        start_method: ``"popen"`` re-runs the script per rank (scripts, Hydra); ``"spawn"``/``"fork"``
            start workers from a running interpreter (notebooks, tests). torchrun and SLURM are detected
            through Lightning's cluster environments and need no option.
        process_group_backend: ``"nccl"``/``"gloo"``; ``None`` picks nccl on CUDA and gloo on CPU. ``"cuda:gloo"``
            runs several ranks on one GPU (with ``parallel_devices=[cuda:0, cuda:0]``; NCCL refuses that): gloo for
            CUDA tensors only, so host tensors are refused as on NCCL.
        timeout: Seconds (or a ``timedelta``) a collective may wait before the job fails instead of hanging.
        save_format: ``"sharded"``: each rank writes its own shards (a directory, through
            ``torch.distributed.checkpoint``); ``"full"``: whole tensors in one file that loads into the plain
            module. Any layout resumes from either. Checkpoints appear under their name only when complete.
        async_save: Write checkpoints in the background while training goes on (tensors are copied to host
            memory first); each save is completed before the next one, before a load and at the end.
        weights_from: Pretrained weights read into this rank's part of the model before training (each rank
            reads only the slices it holds): a full checkpoint file, a sharded checkpoint directory, or a Hugging
            Face model directory (``*.safetensors``, sharded with ``model.safetensors.index.json`` or not).
        trust_pickle: Unpickle a ``weights_from`` checkpoint in full, which runs any code the file names. Off, a
            file holding objects other than tensors, plain containers and the few types our own checkpoints hold
            is refused (nothing of it runs); turn it on only for files you trust. Resuming follows Lightning's
            ``weights_only`` (``trainer.fit(..., weights_only=False)`` trusts the checkpoint).
        init_values: For a module built on the meta device: ``"eager"`` gives it the values eager construction on
            the host gives (bit for bit; each module materialised whole on the host in turn); ``"draw_into_shards"``
            draws the same distribution straight into each rank's shards on its device (no whole module anywhere,
            at the device's speed; not the same bits). See docs/gpu.md.
        checkpoint_io: Defaults to :class:`~lightning_parallel.checkpoint.io.ParallelCheckpointIO` (atomic files).

    A module built under ``with trainer.init_module(empty_init=True):`` has its parameters on the meta device
    (no memory); setup splits it there and allocates and initialises only this rank's part, with the values
    eager construction gives (see :mod:`lightning_parallel.parallelize.placement.deferred_init`).
    """

    #: Presets: engine argument -> config dataclass whose fields they take as flat keywords (see options.py).
    preset_configs: ClassVar[dict[str, type]] = {}
    #: Presets: a flat keyword's default where the preset deliberately differs from the dataclass's.
    preset_defaults: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.preset_configs:  # help(DataParallelStrategy) and IDEs show every option with its real default
            cls.__signature__ = preset_signature(cls, ParallelEngineStrategy.__init__, CONFIG_ARGUMENTS)

    @classmethod
    def preset_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """A preset's flat keywords as the engine's arguments: one config per component, the rest as given."""
        return preset_options(cls, options, ParallelEngineStrategy.__init__, CONFIG_ARGUMENTS)

    def __init__(
        self,
        layout: ParallelLayout | None = None,
        *,
        data_parallel: DataParallelConfig | None = None,
        tensor_parallel: TensorParallelConfig | None = None,
        pipeline: PipelineConfig | None = None,
        activation_checkpointing: str | Sequence[str] | None = None,
        periodic_sync: SyncConfig | None = None,
        compilation: CompileConfig | None = None,
        sync_batchnorm: bool = False,
        track_communication: bool = True,
        nonfinite: str = "error",
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT_S,
        save_format: CheckpointFormat = "sharded",
        async_save: bool = False,
        weights_from: str | None = None,
        trust_pickle: bool = False,
        init_values: str = "eager",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            layout,
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        for name, value, expected in (("data_parallel", data_parallel, DataParallelConfig),
                                      ("tensor_parallel", tensor_parallel, TensorParallelConfig),
                                      ("pipeline", pipeline, PipelineConfig), ("periodic_sync", periodic_sync, SyncConfig),
                                      ("compilation", compilation, CompileConfig)):
            if value is not None and not isinstance(value, expected):
                raise TypeError(f"{name} must be a {expected.__name__}, got {type(value).__name__}.")
        self.checkpoint_files = CheckpointFiles(self, save_format, async_save, self._timeout)
        self.checkpoint_state = CheckpointState(self, self.checkpoint_files)
        self._comm_stats: CommStats | None = CommStats() if track_communication else None
        self._forward_redirection = _DDPForwardRedirection()
        self._accumulating = False  # inside Lightning's block_backward_sync (a micro-batch before the last)
        self.tensor_parallel = TensorParallelComponent(self, tensor_parallel or TensorParallelConfig())
        self.pipeline_parallel = PipelineComponent(self, pipeline or PipelineConfig())
        self.expert_parallel = ExpertParallelComponent(self)
        self.activation_checkpointing = ActivationCheckpointingComponent(self, activation_checkpointing)
        self.compile = CompileComponent(self, compilation or CompileConfig())
        self.context_parallel = ContextParallelComponent(self)
        self.placement = ModelPlacement(self, None if weights_from is None else str(weights_from), trust_pickle, init_values)
        self.data_parallel = DataParallelComponent(
            self, data_parallel or DataParallelConfig(), periodic_sync or SyncConfig(), sync_batchnorm
        )
        self.nonfinite = NonFiniteGuard(self, nonfinite)
        self.progress = ProgressReport(self)
        self.weight_averaging = WeightAveragingSupport(self)  # Lightning's WeightAveraging callbacks, shard for shard
        lightning_callbacks.install_tuner_check()  # Tuner.scale_batch_size checks before any hook: our refusal first

    # ------------------------------------------------------------------ properties

    @property
    def components(self) -> tuple[Component, ...]:
        """The parallelisms, in the order they are applied (tensor → pipeline → experts → checkpointing → compile →
        context (the sequence split at each model call) → this rank's part onto its device → data), after the record of where each rank is (outermost: a pipeline runs
        steps without the inner components) and before the check of every step's loss and gradients
        (innermost around the optimizer step)."""
        return (
            self.progress, self.tensor_parallel, self.pipeline_parallel, self.expert_parallel, self.activation_checkpointing,
            self.compile, self.context_parallel, self.placement, self.data_parallel, self.nonfinite,
        )

    @property
    def tensor_parallel_config(self) -> TensorParallelConfig:
        """The tensor-parallel plan and options (used when ``tensor_parallel_size > 1``)."""
        return self.tensor_parallel.config

    @property
    def parameters_are_dtensors(self) -> bool:
        """Whether parameters are DTensors (split by TP, experts divided by EP, or sharded over dp by FSDP2)."""
        return self.tensor_parallel.enabled or self.expert_parallel.enabled or self.data_parallel.shards

    @property
    def pipeline_runner(self) -> PipelineRunner | None:
        """This rank's pipeline (``None`` without pipeline parallelism or before setup)."""
        return self.pipeline_parallel.runner

    @property
    def comm_stats(self) -> CommStats | None:
        """Gradient communication counted so far on this rank (``None`` if tracking is off)."""
        return self._comm_stats

    @override
    def _data_parallel_shard_size(self, layout: ParallelLayout, devices_per_node: int) -> int:
        config = self.data_parallel.config
        # Context-parallel peers sit between tensor- and data-parallel ranks: a node holds devices / (tp × cp) of the latter.
        inner = layout.tensor_parallel_size * layout.context_parallel_size
        return config.shard_size_for(layout.data_parallel_size, inner, devices_per_node)

    @override
    def _validate(self, layout: ParallelLayout) -> None:
        for component in self.components:
            component.validate(layout)

    @override
    def _check_backend(self, backend: str) -> None:
        self.data_parallel.config.check_backend(backend)

    def planned_layout(self, layout: ParallelLayout | None = None) -> Layout:
        """A layout (by default this strategy's resolved one) in the planner's terms: sizes, data-parallel
        mode, schedule, checkpointing."""
        return Layout.from_parallel(
            layout if layout is not None else self.layout,
            self.data_parallel.config.mode,
            self.pipeline_parallel.config,
            activation_checkpointing=bool(self.activation_checkpointing.patterns),
            gradient_as_bucket_view=self.data_parallel.config.gradient_as_bucket_view,
        )

    @override
    def _before_collective(self, name: str) -> None:
        self.progress.record_collective(name)

    def record_gradient_round(self, sent_bytes: int, seconds: float) -> None:
        """Count one gradient synchronization outside DDP's hook (pipeline replicas, periodic sync)."""
        if self._comm_stats is not None:
            self._comm_stats.record_round(sent_bytes, seconds=seconds)

    # ------------------------------------------------------------------ setup

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # Before the callbacks' setup, where Lightning's WeightAveraging would copy the whole, unsplit module.
        module = self.lightning_module
        self.weight_averaging.take_over(getattr(module, "_trainer", None))
        lightning_callbacks.check(self, getattr(module, "_trainer", None))  # SWA, pruning: refused with the fix

    @override
    def setup(self, trainer: Trainer) -> None:
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        for component in self.components:
            component.prepare(trainer, fitting)
        self.precision_plugin.convert_module(self.model)
        # No model_to_device() here: the placement component moves only this rank's part, after the split.
        for component in self.components:
            component.apply(trainer, fitting)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self.parameters_are_dtensors and not self.pipeline_parallel.enabled:
            # Lightning clips through the precision plugin with torch's clip_grad_norm_, which refuses the
            # mix of DTensor and plain gradients that TP leaves; give this plugin the mesh-aware version.
            # nn.ModuleList experts divided by expert parallelism: each rank's share of their norm is summed over ep.
            divided = self.expert_parallel.divided_apart
            self.precision_plugin.clip_grad_by_norm = (
                clip_optimizer_grad_norm if divided is None else partial(clip_optimizer_grad_norm, divided=divided)
            )
        self.checkpoint_state.after_setup()
        self.weight_averaging.after_setup()
        grad_norms.attach(self)  # Lightning's grad_norm of this module: whole-model norms on every rank
        lightning_callbacks.attach(self, trainer)  # finetuning's parameter comparison, throughput's replica count

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module()``: with ``empty_init=True`` parameters are built on the meta device (no
        memory; buffers as usual) and each rank materialises only its part in setup."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with parameters_on_meta(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Lightning's wrapper around a custom sampler hides that sampler's state: split it in lockstep
        # instead, so that a checkpoint resumes the same order (under any data-parallel size).
        return split_custom_sampler(dataloader)

    # ------------------------------------------------------------------ steps

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("training_step", super().training_step, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("validation_step", super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("test_step", super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._run_step("predict_step", super().predict_step, args, kwargs)

    def _run_step(self, hook: str, step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Lightning's ``step``, wrapped by each component (the first outermost); a pipeline runs it itself."""
        run: Callable[[], Any] = partial(step, *args, **kwargs)
        for component in reversed(self.components):
            run = partial(component.around_step, hook, run, args, kwargs)
        return run()

    @override
    def backward(self, closure_loss: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        run: Callable[[], Tensor] = partial(super().backward, closure_loss, *args, **kwargs)
        for component in reversed(self.components):
            run = partial(component.around_backward, run, closure_loss)
        loss = run()
        for component in self.components:
            component.after_backward(self._accumulating)
        return loss

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        # With manual optimization Lightning does not go through DDP's forward bookkeeping for backward.
        if isinstance(self.model, DistributedDataParallel) and not self.lightning_module.automatic_optimization:
            prepare_for_backward(self.model, closure_loss)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's accumulation micro-batches (all but the last): no component reduces gradients."""
        self._accumulating = True
        try:
            with ExitStack() as stack:
                for component in self.components:
                    stack.enter_context(component.gradient_sync_blocked())
                yield
        finally:
            self._accumulating = False

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        parent = super().optimizer_step

        def run(closure: Callable[[], Any]) -> Any:
            return parent(optimizer, closure, model, **kwargs)

        for component in reversed(self.components):
            run = partial(component.around_optimizer_step, optimizer, run=run)
        return run(closure)

    # ------------------------------------------------------------------ checkpoints (checkpoint_files.py, checkpoint_state.py)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Lightning passes fit(weights_only=...) only to the restore that runs before setup. The model's
        # tensors are loaded at the end of setup all the same (CheckpointState.load_model_state).
        return False

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self.checkpoint_files.save(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpoint_files.load(checkpoint_path, weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoint_files.remove(filepath)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpoint_state.model_state()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.checkpoint_state.optimizer_state(optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self.checkpoint_state.load_model_state(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self.checkpoint_state.load_optimizer_state(checkpoint)

    def finish_pending_save(self) -> None:
        """Wait until a checkpoint written in the background is complete (``async_save=True``)."""
        self.checkpoint_files.finish_pending_save()

    @override
    def on_train_start(self) -> None:
        self.checkpoint_files.on_train_start()
        super().on_train_start()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.checkpoint_files.on_train_batch_start(batch_idx)
        super().on_train_batch_start(batch, batch_idx)

    # ------------------------------------------------------------------ errors and teardown

    @override
    def on_exception(self, exception: BaseException) -> None:
        for component in self.components:
            component.on_exception(exception)
        _augment_message(exception, pattern=grad_norms.UNALLOCATED, new_message=grad_norms.HINT)

    @override
    def teardown(self) -> None:
        grad_norms.detach(self)
        lightning_callbacks.detach(self)
        self.checkpoint_state.teardown()
        self.checkpoint_files.teardown()
        for component in reversed(self.components):
            component.teardown()
        # As Lightning's ModelParallelStrategy: the model and optimizer state stay where they are. Its parent's
        # teardown copies both to host memory, which for a model the size of a node's GPUs costs minutes and may not
        # fit in the host's memory; the trained weights are in the checkpoint or read on the device.
        for part in (self.cluster_environment, self.precision_plugin, self.accelerator, self.checkpoint_io):
            if part is not None:
                part.teardown()
