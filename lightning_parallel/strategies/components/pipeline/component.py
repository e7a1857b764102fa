"""Pipeline parallelism in the engine: step hooks through the schedule, gradients handed to Lightning.

The pipeline owns backward: the schedule runs it inside ``training_step``, and Lightning's own backward
call hands the gradients over (Lightning zeroes gradients between the two). Gradients of replicated
stages (and of tied weights split over stages) are reduced once per optimizer step, after the last
accumulated micro-step. With ``tensor_parallel_size > 1`` each stage is split over the ``tp`` mesh after the
cut, by the tensor-parallel component's plan. Under a sharded ``data_parallel_mode`` the stages' parameters are
then sharded over the data-parallel ranks (:mod:`lightning_parallel.parallelize.pipeline.sharded_stages`): gathered
once per optimizer step, reduce-scattered once after the last accumulated micro-step; routed experts that expert
parallelism divided over ``ep`` are left out of that sharding (it reduces their gradients itself).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_parallel.collectives import sync_module_states
from lightning_parallel.layout import ParallelLayout, replica_mesh
from lightning_parallel.parallelize.common.grad_norm import clip_grad_norm_
from lightning_parallel.parallelize.context.traced import StageSequenceSplit
from lightning_parallel.parallelize.data.grad_sync import average_gradients, sum_gradients
from lightning_parallel.parallelize.pipeline.config import PipelineConfig
from lightning_parallel.parallelize.pipeline.build import LocalPipeline, remap_optimizer, replace_stage_tensors
from lightning_parallel.parallelize.pipeline.sharded_stages import ShardedStageParameters
from lightning_parallel.parallelize.placement.deferred_init import allocate_local, has_meta_tensors
from lightning_parallel.parallelize.tensor.sequence import reduce_partial_gradients
from lightning_parallel.strategies.optimizer import unwrap_optimizer
from lightning_parallel.strategies.components.base import Component
from lightning_parallel.strategies.components.pipeline.runner import PipelineRunner

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost

#: Lightning hooks that run through the pipeline, and whether they train.
PIPELINED_HOOKS = {"training_step": True, "validation_step": False, "test_step": False, "predict_step": False}


class PipelineComponent(Component):
    """Cuts the module into stages over the ``pp`` axis (on the first batch) and runs every step hook through them."""

    def __init__(self, engine: EngineHost, config: PipelineConfig) -> None:
        super().__init__(engine)
        self.config = config
        self.runner: PipelineRunner | None = None
        self._pending_gradients: list[tuple[torch.nn.Parameter, Tensor]] = []

    @property
    def enabled(self) -> bool:
        return self.engine.layout.pipeline_parallel_size > 1

    @property
    def staged(self) -> bool:
        """Whether the module has been cut into pipeline stages on this rank."""
        return self.runner is not None and self.runner.built

    def validate(self, layout: ParallelLayout) -> None:
        if layout.pipeline_parallel_size > 1:
            self.config.check(layout.pipeline_parallel_size)

    def apply(self, trainer: Trainer, fitting: bool) -> None:
        if not self.enabled:
            return
        engine = self.engine
        module = engine.lightning_module
        if not module.automatic_optimization:
            raise ValueError(
                "Pipeline parallelism runs backward inside its schedule, so it needs automatic optimization; "
                f"{type(module).__name__} sets automatic_optimization=False."
            )
        if engine._layer_sync is not None:
            raise ValueError("Trainer(sync_batchnorm=True) is not supported with pipeline parallelism; remove it.")
        # Stages are cut on the first batch (tracing needs real inputs); until then every rank holds the
        # whole module, starting from rank 0's weights so that replicas agree.
        if not self.staged and not engine.placement.deferred:
            sync_module_states(engine.model)
        if self.runner is None:
            mesh, layout = engine.device_mesh, engine.layout
            tensor = engine.tensor_parallel
            self.runner = PipelineRunner(
                self.config,
                pp_size=layout.pipeline_parallel_size,
                pp_rank=engine.coordinates.pp,
                pp_global_ranks=layout.group_ranks("pp", engine.global_rank),
                pp_group=mesh["pp"].get_group(),
                device=engine.root_device,
                tensor_parallel=tensor.stage_plan if tensor.enabled else None,
                activation_checkpointing=engine.activation_checkpointing.patterns,
                compile_stages=engine.compile.stage_compiler if engine.compile.enabled else None,
                allocate_later=engine.data_parallel.shards,  # shard on the meta device, then allocate the shards
                divided_later=engine.expert_parallel.parameter_names_under,  # divide on meta, then allocate
                sequence_split=_sequence_split(engine),
            )
        # Clipping must see the norm of the whole model: every stage's gradients, tied weights once.
        engine.precision_plugin.clip_grad_by_norm = partial(_clip_pipeline, self)

    def around_step(self, hook: str, run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.enabled:
            return run()
        runner = self.runner
        if runner is None:
            raise RuntimeError("The pipeline is created in setup(); a step ran before it.")
        engine = self.engine
        training = PIPELINED_HOOKS[hook]
        module = engine.lightning_module
        plugin = engine.precision_plugin
        scale = loss_factor(plugin, module.trainer.accumulate_grad_batches, engine.root_device) if training else 1.0
        context = plugin.train_step_context() if training else plugin.val_step_context()
        # Lightning zeroes gradients *after* training_step and before backward, but the schedule computes
        # them inside the step: set them aside here and hand them over in backward(). Set aside, they would live
        # beside the new ones through the whole schedule (one more gradient set per rank), so where Lightning's own
        # zeroing would discard them they are freed instead, and where it keeps them (a micro-step inside an
        # accumulation window) the schedule adds to them in place; sharded stages keep theirs aside (FSDP2 owns them).
        earlier: list[tuple[torch.nn.Parameter, Tensor]] = []
        if training:
            if _zeroed_after_step(module):
                _take_gradients(module)
            elif not _accumulating_in_place(module) or runner.sharded is not None:
                earlier = _take_gradients(module)
        with context:
            output = runner.run(module, hook, args, kwargs, training=training, loss_scale=scale, on_build=self._on_built)
        if training:
            self._pending_gradients = _take_gradients(module)
            for param, grad in earlier:
                param.grad = grad
        return output

    def around_backward(self, run: Callable[[], Tensor], loss: Tensor) -> Tensor:
        if not self.enabled:
            return run()
        # The schedule ran backward inside training_step, micro-batch by micro-batch: add its gradients.
        for param, grad in self._pending_gradients:
            param.grad = grad if param.grad is None else param.grad.add_(grad)
        self._pending_gradients = []
        return loss

    def after_backward(self, accumulating: bool) -> None:
        if self.enabled and not accumulating:
            self._reduce_gradients()

    def _on_built(self, local: LocalPipeline) -> None:
        placement = self.engine.placement
        # Experts of this rank's stages divided over ep (the trace saw them whole; their calls are opaque operators).
        experts = self.engine.expert_parallel.divide_stage_experts()
        replace_stage_tensors(local, experts)
        for optimizer in self.engine.optimizers:
            remap_optimizer(unwrap_optimizer(optimizer), experts)
        # Sharded stages first: a meta-built stage is sharded on the meta device and only the shards get memory.
        sharded = self._shard_stages(local) if self.engine.data_parallel.shards else None
        local.replaced.update(placement.allocate_outside_stages())
        for optimizer in self.engine.optimizers:
            remap_optimizer(unwrap_optimizer(optimizer), local.replaced)
            if sharded is not None:
                remap_optimizer(unwrap_optimizer(optimizer), sharded.replaced)
        placement.place_stages(local.local_tensors, self.runner.root_name or "")
        self.engine.weight_averaging.after_stages_built()  # Lightning's WeightAveraging: averages of the stages' tensors

    def _shard_stages(self, local: LocalPipeline) -> ShardedStageParameters:
        """Shard this rank's stage parameters over the data-parallel ranks (FSDP2 over the module holding them)."""
        engine = self.engine
        runner = self.runner
        holder = engine.lightning_module.get_submodule(runner.root_name or "")
        device = engine.root_device

        def allocate_shards(sharded_holder: torch.nn.Module) -> None:
            if has_meta_tensors(sharded_holder):  # built on the meta device: memory for this rank's shards only
                allocate_local(sharded_holder, device)

        sharded = ShardedStageParameters(
            # In the parameters' own dtype under bf16-mixed too (what the stages were traced with; gradients summed in float32).
            holder, replica_mesh(engine.device_mesh, sharded=True), allocate_shards,
            # Routed experts divided over ep (just before): expert parallelism holds and reduces them, as without pipelines.
            ignored_params=set(engine.expert_parallel.held_parameters),
        )
        # Starting values and new traces (other shapes) go to these tensors by name: the shards, not the whole.
        current = sharded.tensors()
        local.local_tensors = {name: current.get(name, t) for name, t in local.local_tensors.items()}
        sharded.adopt(stage.submod for stage in [*local.train_stages, *local.eval_stages])
        runner.sharded = sharded
        return sharded

    def _reduce_gradients(self) -> None:
        engine = self.engine
        module = engine.lightning_module
        sharded = self.runner.sharded
        start, sent = time.perf_counter(), 0
        if sharded is not None:
            sent += sharded.reduce()  # one reduce-scatter per unit, averaged over dp
        # Tensor-parallel stages leave partial sums for replicated weights used after a row-wise split.
        reduce_partial_gradients(module.parameters())
        for param, group in self.runner.tied_parameters(module):
            sum_gradients([param], group)
        if engine.layout.data_parallel_size * engine.layout.context_parallel_size > 1:
            sharded_ids = {id(p) for p in sharded.replaced.values()} if sharded is not None else set()
            sharded_ids |= {id(p) for p in engine.expert_parallel.held_parameters}  # reduced by expert parallelism
            # Context-parallel peers hold partial gradients of the same weights: averaged with the replicas (dp × cp).
            cp = engine.layout.context_parallel_size > 1
            group = replica_mesh(engine.device_mesh).get_group() if cp else engine.data_parallel_group
            sent += average_gradients([p for p in module.parameters() if id(p) not in sharded_ids], group)
            engine.record_gradient_round(sent, time.perf_counter() - start)


def _sequence_split(engine: EngineHost) -> StageSequenceSplit | None:
    """Context parallelism for the stages, when ``context_parallel_size > 1``."""
    if engine.layout.context_parallel_size == 1:
        return None
    cp_mesh = engine.device_mesh["cp"]
    return StageSequenceSplit(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())


def loss_factor(plugin: Any, accumulate_grad_batches: int, device: torch.device) -> float | Tensor:
    """What each micro-batch's loss is multiplied by before the schedule's backward.

    ``1 / accumulate_grad_batches``, as Lightning divides a step's loss; under fp16 also the GradScaler's current
    scale, which Lightning applies in ``pre_backward`` to the loss it back-propagates. The schedule runs backward
    itself, so without it gradients would reach the scaler's ``unscale_`` unscaled and come out divided by the scale
    (65536 at first). The scale stays a device tensor: no host read.
    """
    factor = 1.0 / accumulate_grad_batches
    scaler = getattr(plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return factor
    return scaler.scale(torch.full((), factor, dtype=torch.float32, device=device))


def _zeroed_after_step(module: torch.nn.Module) -> bool:
    """Whether Lightning zeroes the gradients between this ``training_step`` and its backward, with its own
    ``optimizer_zero_grad``: automatic optimization, the first batch of an accumulation window (the rule of
    Lightning's ``_AutomaticOptimization._make_zero_grad_fn``). A module that overrides ``optimizer_zero_grad``
    may keep some gradients: its earlier gradients are then set aside and handed back, as before."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or not isinstance(module, LightningModule) or not module.automatic_optimization:
        return False
    if type(module).optimizer_zero_grad is not LightningModule.optimizer_zero_grad:
        return False
    return trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0


def _accumulating_in_place(module: torch.nn.Module) -> bool:
    """Whether Lightning keeps the gradients through this ``training_step`` and its backward: automatic
    optimization, a batch after the first of its accumulation window (no zeroing is called at all)."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or not isinstance(module, LightningModule) or not module.automatic_optimization:
        return False
    return trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches != 0


def _take_gradients(module: torch.nn.Module) -> list[tuple[torch.nn.Parameter, Tensor]]:
    taken = [(p, p.grad) for p in module.parameters() if p.grad is not None]
    for param, _ in taken:
        param.grad = None
    return taken


def _clip_pipeline(pipeline: PipelineComponent, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
    runner = pipeline.runner
    module = pipeline.engine.lightning_module
    duplicates = runner.norm_duplicates(module) if runner is not None else []
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    clip_grad_norm_(parameters, clip_val, exclude_from_norm=duplicates, sum_over=pipeline.engine.device_mesh["pp"].get_group())
