"""``HybridParallelStrategy``: data × context × tensor × pipeline parallelism on one DeviceMesh, with memory options."""

from __future__ import annotations

from typing import Any

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallelize.common.compile import CompileConfig
from lightning_parallel.parallelize.data.replicated import DataParallelConfig
from lightning_parallel.parallelize.data.periodic_sync import SyncConfig
from lightning_parallel.parallelize.pipeline.config import PipelineConfig
from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig
from lightning_parallel.strategies.engine import ParallelEngineStrategy


class HybridParallelStrategy(ParallelEngineStrategy):
    """Any mix of data, context, tensor and pipeline parallelism, for an unmodified LightningModule.

    Ranks form a ``(pp, dp, cp, tp)`` mesh: tensor-parallel peers are adjacent ranks (inside a node, where
    the fast links are), context-parallel peers next, data-parallel replicas next, pipeline stages outermost. Applied in this order:
    the tensor-parallel plan (resolved on the whole module) → the pipeline split (each stage's parameters
    then placed on the ``tp`` mesh by the plan) → activation checkpointing → data parallelism per stage.
    Each size may be 1; one may be ``-1`` (the remaining ranks). The Data/Tensor/Pipeline strategies are
    presets of the same engine.

    Args:
        data_parallel_size: Replicas (``-1``: the ranks the other sizes leave).
        tensor_parallel_size: Ranks that split each layer.
        pipeline_parallel_size: Pipeline ranks.
        context_parallel_size: Ranks that split each sequence (context parallelism): the model call's
            ``[batch, sequence, ...]`` inputs are cut head-tail along dim 1, ``F.scaled_dot_product_attention``
            runs as ring attention, outputs are gathered whole for the step's loss. Sequence lengths must be
            multiples of ``2 × context_parallel_size``; not with ``compile`` or periodic sync yet.
        expert_parallel_size: Of the data-parallel ranks, how many divide each Mixture-of-Experts layer's routed
            experts by expert index (tokens sent to their expert and back by all-to-all, dropless: the math is the
            unsplit model's). Borrowed from data parallelism: must divide ``data_parallel_size``; the world size
            does not change. With tensor parallelism the experts are divided by ep and
            left out of the tp plan. Not with pp, cp or periodic sync yet.
        data_parallel_mode: ``"replicate"`` (ZeRO-0: DDP, or gradient all-reduce per stage),
            ``"shard"`` (ZeRO-3 through FSDP2; ZeRO-2-like with ``reshard_after_forward=False``) or
            ``"hybrid_shard"`` (HSDP: shard within ``data_parallel_shard_size`` ranks, replicate across).
            Sharded modes are not available with pipeline parallelism yet.
        data_parallel_shard_size: Shard group size for ``hybrid_shard`` (``-1``: a node's data-parallel ranks).
        reshard_after_forward: Sharded modes: free gathered parameters after forward.
        activation_checkpointing: ``"auto"`` (each block of the model's trunk) or module-name patterns.
        plan: Tensor-parallel plan, ``"auto"`` or ``{pattern: style}`` (as ``TensorParallelStrategy``).
        head_attributes: Head-count attributes divided on split attention modules (without pipeline).
        sequence_parallel: Megatron sequence parallelism (without pipeline parallelism).
        schedule: Pipeline schedule (as ``PipelineParallelStrategy``).
        microbatches: Micro-batches per batch.
        stages_per_rank: Virtual pipeline stages per rank.
        split_points: ``"auto"`` or module names where stages 1, 2, ... begin.
        balance: ``"params"`` or ``"time"`` for ``split_points="auto"``.
        bucket_cap_mb, find_unused_parameters, static_graph, gradient_as_bucket_view, comm_hook,
        powersgd_rank, powersgd_start_iter: DDP options (``data_parallel_mode="replicate"`` without TP/PP).
        sync_batchnorm: BatchNorm statistics over the data-parallel batch (without pipeline).
        track_communication: Count DDP gradient buckets and pipeline gradient rounds in ``comm_stats``.
        start_method: ``"popen"`` (scripts, Hydra, torchrun, SLURM), ``"spawn"`` or ``"fork"``.
        process_group_backend: ``None`` (nccl on CUDA, gloo on CPU), or a backend name.
        timeout: Seconds a collective may wait before the job fails.
        **kwargs: Passed to :class:`ParallelEngineStrategy`.

    Example:
        >>> Trainer(devices=8, strategy=HybridParallelStrategy(2, 2, 2, schedule="1f1b", microbatches=4))  # doctest: +SKIP
    """

    preset_configs = {
        "data_parallel": DataParallelConfig,
        "periodic_sync": SyncConfig,
        "tensor_parallel": TensorParallelConfig,
        "pipeline": PipelineConfig,
        "compilation": CompileConfig,
    }

    def __init__(
        self,
        data_parallel_size: int = -1,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        **options: Any,
    ) -> None:
        layout = ParallelLayout(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            context_parallel_size=context_parallel_size,
            expert_parallel_size=expert_parallel_size,
        )
        super().__init__(layout=layout, **self.preset_options(options))
