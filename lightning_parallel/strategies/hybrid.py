"""``HybridParallelStrategy``: data × tensor × pipeline parallelism on one DeviceMesh, with memory options."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallelize.data import DataParallelConfig
from lightning_parallel.parallelize.periodic_sync import SyncConfig
from lightning_parallel.parallelize.pipeline import PipelineConfig
from lightning_parallel.parallelize.tensor import HEAD_ATTRIBUTES, TensorParallelConfig
from lightning_parallel.strategies.engine import (
    DEFAULT_TIMEOUT_S,
    ParallelEngineStrategy,
)
from lightning_parallel.strategies.launch import StartMethod


class HybridParallelStrategy(ParallelEngineStrategy):
    """Any mix of data, tensor and pipeline parallelism (3-D), for an unmodified LightningModule.

    Ranks form a ``(pp, dp, tp)`` mesh: tensor-parallel peers are adjacent ranks (inside a node, where
    the fast links are), data-parallel replicas next, pipeline stages outermost. Applied in this order:
    the tensor-parallel plan (resolved on the whole module) → the pipeline split (each stage's parameters
    then placed on the ``tp`` mesh by the plan) → activation checkpointing → data parallelism per stage.
    Each size may be 1; one may be ``-1`` (the remaining ranks). The Data/Tensor/Pipeline strategies are
    presets of the same engine.

    Args:
        data_parallel_size: Replicas (``-1``: the ranks the other sizes leave).
        tensor_parallel_size: Ranks that split each layer.
        pipeline_parallel_size: Pipeline ranks.
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

    def __init__(
        self,
        data_parallel_size: int = -1,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        *,
        data_parallel_mode: str = "replicate",
        data_parallel_shard_size: int = -1,
        reshard_after_forward: bool = True,
        activation_checkpointing: str | Sequence[str] | None = None,
        plan: str | Mapping[str, str] = "auto",
        head_attributes: tuple[str, ...] | list[str] = HEAD_ATTRIBUTES,
        sequence_parallel: bool = False,
        schedule: str = "1f1b",
        microbatches: int = 4,
        stages_per_rank: int = 1,
        split_points: str | Sequence[str] = "auto",
        balance: str = "params",
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        comm_hook: str = "allreduce",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 1000,
        sync: str = "every_step",
        sync_every: int = 1,
        sync_warmup_steps: int = 0,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        sync_batchnorm: bool = False,
        track_communication: bool = True,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: float | timedelta = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            layout=ParallelLayout(
                data_parallel_size=data_parallel_size,
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
            ),
            data_parallel=DataParallelConfig(
                mode=data_parallel_mode,
                shard_size=data_parallel_shard_size,
                reshard_after_forward=reshard_after_forward,
                bucket_cap_mb=bucket_cap_mb,
                find_unused_parameters=find_unused_parameters,
                static_graph=static_graph,
                gradient_as_bucket_view=gradient_as_bucket_view,
                comm_hook=comm_hook,
                powersgd_rank=powersgd_rank,
                powersgd_start_iter=powersgd_start_iter,
            ),
            tensor_parallel=TensorParallelConfig(
                plan=plan, head_attributes=tuple(head_attributes), sequence_parallel=sequence_parallel
            ),
            pipeline=PipelineConfig(
                schedule=schedule,
                microbatches=microbatches,
                stages_per_rank=stages_per_rank,
                split_points=split_points,
                balance=balance,
            ),
            periodic_sync=SyncConfig(
                method=sync,
                sync_every=sync_every,
                warmup_steps=sync_warmup_steps,
                outer_lr=outer_lr,
                outer_momentum=outer_momentum,
                outer_nesterov=outer_nesterov,
            ),
            activation_checkpointing=activation_checkpointing,
            sync_batchnorm=sync_batchnorm,
            track_communication=track_communication,
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **kwargs,
        )
