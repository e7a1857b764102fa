"""The engine's pipeline part: step hooks through the schedule, gradients at the optimizer step, clipping.

Mixed into :class:`~lightning_parallel.strategies.engine.ParallelEngineStrategy`, which provides
``layout``, ``coordinates``, ``device_mesh``, ``root_device``, ``model``, ``lightning_module``,
``optimizers``, ``precision_plugin``, ``data_parallel_group``, ``_pipeline`` and ``_tensor_parallel`` (the
configs), ``_activation_checkpointing``, ``_sync_batchnorm``, ``_layer_sync``, ``_accumulating`` and
``_comm_stats``. With ``tensor_parallel_size > 1`` each stage is split over the ``tp`` mesh after the cut.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallelize.grad_norm import clip_grad_norm_
from lightning_parallel.parallelize.grad_sync import average_gradients, sum_gradients
from lightning_parallel.parallelize.pipeline_build import LocalPipeline, remap_optimizer
from lightning_parallel.parallelize.sequence import reduce_partial_gradients
from lightning_parallel.parallelize.stage_tensor import StageTensorParallel
from lightning_parallel.parallelize.tensor import check_plan
from lightning_parallel.strategies.pipeline_runner import PipelineRunner
from lightning_parallel.strategies.whole_state import unwrap_optimizer

#: Lightning hooks that run through the pipeline, and whether they train.
PIPELINED_HOOKS = {"training_step": True, "validation_step": False, "test_step": False, "predict_step": False}


class PipelineStepsMixin:
    """Runs the LightningModule's step methods through a pipeline when ``pipeline_parallel_size > 1``.

    The strategy owns backward here: the schedule runs it inside ``training_step``, and Lightning's own
    backward call hands the gradients over (Lightning zeroes gradients between the two). Gradients of replicated stages (and of tied weights split over stages)
    are reduced once per optimizer step, after the last accumulated micro-step.
    """

    _pipeline_runner: PipelineRunner | None
    _pending_gradients: list[tuple[torch.nn.Parameter, torch.Tensor]]

    @property
    def _is_pipelined(self) -> bool:
        return self.layout.pipeline_parallel_size > 1

    @property
    def pipeline_runner(self) -> PipelineRunner | None:
        """This rank's pipeline (``None`` without pipeline parallelism or before setup)."""
        return self._pipeline_runner

    def _check_pipeline_layout(self, layout: ParallelLayout) -> None:
        """Refuse, before any process starts, what pipelines cannot do (yet)."""
        if layout.pipeline_parallel_size == 1:
            return
        if layout.tensor_parallel_size > 1 and self._tensor_parallel.sequence_parallel:
            raise ValueError(
                "sequence_parallel=True is not supported with pipeline_parallel_size > 1 (traced stages run in DTensor's "
                "global view, without the sequence-sharded regions); set sequence_parallel=False."
            )
        if self._sync_batchnorm:
            raise ValueError(
                "sync_batchnorm=True is not supported with pipeline_parallel_size > 1 (a stage's batch statistics are "
                "its micro-batch's); set sync_batchnorm=False."
            )
        self._pipeline.check(layout.pipeline_parallel_size)

    def _setup_pipelined(self, trainer: Trainer, fitting: bool) -> None:
        """The engine's ``setup`` under pipeline parallelism: no wrappers, optimizers, the runner."""
        if not self.lightning_module.automatic_optimization:
            raise ValueError(
                "Pipeline parallelism runs backward inside its schedule, so it needs automatic optimization; "
                f"{type(self.lightning_module).__name__} sets automatic_optimization=False."
            )
        if self._layer_sync is not None:
            raise ValueError("Trainer(sync_batchnorm=True) is not supported with pipeline parallelism; remove it.")
        # Stages are cut on the first batch (tracing needs real inputs); until then every rank holds the
        # whole module, starting from rank 0's weights so that replicas agree.
        if self._pipeline_runner is None or not self._pipeline_runner.built:
            _sync_module_states(self.model)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._setup_runner()

    def _setup_runner(self) -> None:
        if self._pipeline_runner is None:
            mesh = self.device_mesh
            self._pipeline_runner = PipelineRunner(
                self._pipeline,
                pp_size=self.layout.pipeline_parallel_size,
                pp_rank=self.coordinates.pp,
                pp_global_ranks=self.layout.group_ranks("pp", self.global_rank),
                pp_group=mesh["pp"].get_group(),
                device=self.root_device,
                tensor_parallel=self._stage_tensor_parallel if self.layout.tensor_parallel_size > 1 else None,
                activation_checkpointing=self._activation_checkpointing,
            )
        # Clipping must see the norm of the whole model: every stage's gradients, tied weights once.
        self.precision_plugin.clip_grad_by_norm = partial(_clip_pipeline, self)

    def _stage_tensor_parallel(self, root_name: str) -> StageTensorParallel:
        """The tensor-parallel plan for the stages of ``root_name`` (resolved on the whole module, before the cut)."""
        module = self.lightning_module
        resolved = self._tensor_parallel.resolve(module, warn=rank_zero_warn)
        check_plan(module, resolved, self.layout.tensor_parallel_size)
        rank_zero_info(
            f"lightning_parallel: tensor-parallel plan over tp={self.layout.tensor_parallel_size} inside each stage:\n"
            f"{resolved.describe()}"
        )
        return StageTensorParallel.from_plan(resolved, root_name, self.device_mesh["tp"])

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._is_pipelined:
            return self._pipeline_step("validation_step", args, kwargs)
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._is_pipelined:
            return self._pipeline_step("test_step", args, kwargs)
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._is_pipelined:
            return self._pipeline_step("predict_step", args, kwargs)
        return super().predict_step(*args, **kwargs)

    def _pipeline_step(self, hook: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        runner = self._pipeline_runner
        if runner is None:
            raise RuntimeError("The pipeline is created in setup(); a step ran before it.")
        training = PIPELINED_HOOKS[hook]
        module = self.lightning_module
        scale = 1.0 / module.trainer.accumulate_grad_batches if training else 1.0
        context = self.precision_plugin.train_step_context() if training else self.precision_plugin.val_step_context()
        # Lightning zeroes gradients *after* training_step and before backward, but the schedule computes
        # them inside the step: set them aside here and hand them over in backward().
        earlier = _take_gradients(module) if training else []
        with context:
            output = runner.run(module, hook, args, kwargs, training=training, loss_scale=scale, on_build=self._on_pipeline_built)
        if training:
            self._pending_gradients = _take_gradients(module)
            for param, grad in earlier:
                param.grad = grad
        return output

    def _deliver_pipeline_gradients(self) -> None:
        """Add the gradients the last ``training_step`` computed (Lightning's backward under a pipeline)."""
        for param, grad in self._pending_gradients:
            param.grad = grad if param.grad is None else param.grad.add_(grad)
        self._pending_gradients = []
        if not self._accumulating:
            self._reduce_pipeline_gradients()

    def _on_pipeline_built(self, local: LocalPipeline) -> None:
        for optimizer in self.optimizers:
            remap_optimizer(unwrap_optimizer(optimizer), local.replaced)

    def _reduce_pipeline_gradients(self) -> None:
        runner = self._pipeline_runner
        module = self.lightning_module
        # Tensor-parallel stages leave partial sums for replicated weights used after a row-wise split.
        reduce_partial_gradients(module.parameters())
        for param, group in runner.tied_parameters(module):
            sum_gradients([param], group)
        if self.layout.data_parallel_size > 1:
            start = time.perf_counter()
            sent = average_gradients(module.parameters(), self.data_parallel_group)
            if self._comm_stats is not None:
                self._comm_stats.record_round(sent, seconds=time.perf_counter() - start)


def _take_gradients(module: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    taken = [(p, p.grad) for p in module.parameters() if p.grad is not None]
    for param, _ in taken:
        param.grad = None
    return taken


def _clip_pipeline(strategy: PipelineStepsMixin, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
    runner = strategy.pipeline_runner
    duplicates = runner.norm_duplicates(strategy.lightning_module) if runner is not None else []
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    clip_grad_norm_(parameters, clip_val, exclude_from_norm=duplicates, sum_over=strategy.device_mesh["pp"].get_group())
