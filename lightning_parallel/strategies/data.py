"""``DataParallelStrategy``: every rank holds the whole model and trains on its own slice of the batch."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallelize.data import DataParallelConfig
from lightning_parallel.parallelize.periodic_sync import SyncConfig
from lightning_parallel.strategies.engine import (
    DEFAULT_TIMEOUT_S,
    ParallelEngineStrategy,
)
from lightning_parallel.strategies.launch import StartMethod


class DataParallelStrategy(ParallelEngineStrategy):
    """Synchronous data parallelism through torch's DistributedDataParallel.

    Gradients are averaged over the replicas after every backward pass, so training with N replicas of
    batch ``b`` equals single-device training with batch ``N·b``. With
    ``Trainer(accumulate_grad_batches=k)`` the all-reduce runs only on the k-th micro-batch.

    ``data_parallel_mode="shard"`` shards parameters, gradients and optimizer state over the replicas
    instead (FSDP2; ZeRO-3), ``"hybrid_shard"`` shards within a node and replicates across nodes (HSDP).

    Args:
        data_parallel_size: Number of replicas; ``-1`` uses every process.
        data_parallel_mode: ``"replicate"`` (DDP), ``"shard"`` or ``"hybrid_shard"`` (FSDP2).
        data_parallel_shard_size: Shard group size for ``hybrid_shard`` (``-1``: the ranks of one node).
        reshard_after_forward: Sharded modes: free gathered parameters after forward (ZeRO-3) or keep them
            for backward (``False``: ZeRO-2-like, less communication).
        activation_checkpointing: ``"auto"`` (each block of the model's trunk), module-name patterns, or ``None``.
        bucket_cap_mb: Gradient bucket size in MB (fewer, larger all-reduces when raised).
        find_unused_parameters: Allow parameters that get no gradient in a step.
        static_graph: The set of used parameters never changes (lets DDP skip bookkeeping).
        gradient_as_bucket_view: Gradients alias the communication buckets (saves memory).
        comm_hook: ``"allreduce"`` (exact), ``"fp16"``, ``"bf16"`` (NCCL) or ``"powersgd"`` (lossy compression).
        powersgd_rank: Low-rank approximation rank for PowerSGD.
        powersgd_start_iter: Exact steps before PowerSGD compression starts.
        sync: ``"every_step"`` (exact), ``"local_sgd"`` or ``"diloco"`` (replicas step on local gradients and
            synchronize every ``sync_every`` steps; see :mod:`lightning_parallel.parallelize.periodic_sync`).
        sync_every: Optimizer steps between synchronizations (``local_sgd``, ``diloco``).
        sync_warmup_steps: ``local_sgd``: synchronous steps first (post-local SGD).
        outer_lr, outer_momentum, outer_nesterov: ``diloco``'s outer SGD.
        sync_batchnorm: BatchNorm statistics over the global batch instead of each replica's slice.
        track_communication: Count gradient buckets and bytes in :attr:`comm_stats`.
        start_method: ``"popen"`` (scripts, Hydra), ``"spawn"`` or ``"fork"`` (notebooks, tests).
        process_group_backend: ``None`` (nccl on CUDA, gloo on CPU), or a backend name.
        timeout: Seconds a collective may wait before the job fails.
        **kwargs: Passed to :class:`ParallelEngineStrategy` (accelerator, cluster environment, ...).

    Example:
        >>> trainer = Trainer(devices=4, strategy=DataParallelStrategy(comm_hook="fp16"))  # doctest: +SKIP
    """

    def __init__(
        self,
        data_parallel_size: int = -1,
        *,
        data_parallel_mode: str = "replicate",
        data_parallel_shard_size: int = -1,
        reshard_after_forward: bool = True,
        activation_checkpointing: str | Sequence[str] | None = None,
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
            layout=ParallelLayout(data_parallel_size=data_parallel_size),
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
