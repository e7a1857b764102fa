"""``PipelineParallelStrategy``: the model cut into stages across ranks, micro-batches flowing through them."""

from __future__ import annotations

from typing import Any

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallelize.common.compile import CompileConfig
from lightning_parallel.parallelize.pipeline.config import PipelineConfig
from lightning_parallel.strategies.engine import ParallelEngineStrategy


class PipelineParallelStrategy(ParallelEngineStrategy):
    """Pipeline parallelism for an unmodified LightningModule, through ``torch.distributed.pipelining``.

    On the first batch the model the step calls is traced (``torch.export``) and cut at balanced points
    of its layer list; each rank keeps its stage(s) and frees the rest. Every batch is cut into
    ``microbatches`` that flow through the stages in the chosen schedule; the module's own
    ``training_step`` computes each micro-batch's loss on the last stage (its forward call answered by
    the pipeline) and its ``self.log`` values reach every rank. Losses are weighted so that gradients
    equal single-device training on the whole batch, also with ``accumulate_grad_batches``.

    Processes beyond ``pipeline_parallel_size`` form data-parallel replicas of the pipeline (pp × dp):
    each stage's replicas average gradients once per optimizer step.

    Args:
        pipeline_parallel_size: Pipeline ranks; ``-1`` uses every process.
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zero_bubble``,
            ``zbv_zero_bubble`` or ``dualpipev``.
        microbatches: Micro-batches per batch (the batch size must divide by it).
        stages_per_rank: Virtual stages per rank (≥ 2 for the interleaved, looped, zero-bubble and V schedules).
        split_points: ``"auto"`` or module names (relative to the LightningModule) where stages 1, 2, ... begin.
        balance: With ``split_points="auto"``: balance stages by ``"params"`` or measured ``"time"``.
        activation_checkpointing: ``"auto"`` (each block of the trunk) or module-name patterns to checkpoint
            inside the stages, or ``None``.
        start_method: ``"popen"`` (scripts, Hydra, torchrun, SLURM), ``"spawn"`` or ``"fork"``.
        process_group_backend: ``None`` (nccl on CUDA, gloo on CPU), or a backend name.
        timeout: Seconds a collective may wait before the job fails.
        **kwargs: Passed to :class:`ParallelEngineStrategy`.

    Example:
        >>> Trainer(devices=2, strategy=PipelineParallelStrategy(2, schedule="1f1b", microbatches=8))  # doctest: +SKIP
    """

    preset_configs = {"pipeline": PipelineConfig, "compilation": CompileConfig}

    def __init__(self, pipeline_parallel_size: int = -1, **options: Any) -> None:
        layout = ParallelLayout(
            data_parallel_size=-1 if pipeline_parallel_size != -1 else 1, pipeline_parallel_size=pipeline_parallel_size
        )
        super().__init__(layout=layout, **self.preset_options(options))
