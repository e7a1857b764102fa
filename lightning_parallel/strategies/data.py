"""``DataParallelStrategy``: every rank holds the whole model and trains on its own slice of the batch."""

from __future__ import annotations

from typing import Any

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallelize.common.compile import CompileConfig
from lightning_parallel.parallelize.data.replicated import DataParallelConfig
from lightning_parallel.parallelize.data.periodic_sync import SyncConfig
from lightning_parallel.strategies.engine import ParallelEngineStrategy


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
            synchronize every ``sync_every`` steps; see :mod:`lightning_parallel.parallelize.data.periodic_sync`).
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

    preset_configs = {"data_parallel": DataParallelConfig, "periodic_sync": SyncConfig, "compilation": CompileConfig}

    def __init__(self, data_parallel_size: int = -1, **options: Any) -> None:
        super().__init__(layout=ParallelLayout(data_parallel_size=data_parallel_size), **self.preset_options(options))
