"""``TensorParallelStrategy``: each layer's weights split across ranks from a plan, no module changes."""

from __future__ import annotations

from typing import Any

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallelize.common.compile import CompileConfig
from lightning_parallel.parallelize.data.replicated import DataParallelConfig
from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig
from lightning_parallel.strategies.engine import ParallelEngineStrategy


class TensorParallelStrategy(ParallelEngineStrategy):
    """Megatron-style tensor parallelism from configuration, through torch's DTensor ``parallelize_module``.

    The plan says which submodules are split and how: ``plan="auto"`` infers it (attention q/k/v and MLP
    input projections column-wise, output projections row-wise, head counts divided), or give
    ``{glob pattern: style}`` with styles ``colwise``, ``rowwise``, ``embedding_rowwise``, ``replicate``.
    The resolved plan is printed once on rank 0. Every rank of the group sees the same batches.

    With more processes than ``tensor_parallel_size``, the remaining ones form data-parallel replicas of
    the TP group (2-D: dp × tp): since split parameters are DTensors, the replicas use FSDP2
    ``fully_shard`` over the dp mesh dimension — by default sharding parameters, gradients and optimizer
    state over the replicas (``data_parallel_mode="shard"``), or ``"replicate"``/``"hybrid_shard"`` — and
    gradient accumulation skips their gradient reduction on intermediate micro-batches.

    Args:
        tensor_parallel_size: Ranks that split each layer; ``-1`` uses every process.
        plan: ``"auto"`` or a mapping of module-name patterns (relative to the LightningModule) to styles.
        head_attributes: Attribute names of head counts to divide on split attention modules.
        data_parallel_mode: How the replicas hold the TP group's state: ``"shard"`` (ZeRO-3, the default),
            ``"replicate"`` or ``"hybrid_shard"`` (see ``HybridParallelStrategy``).
        activation_checkpointing: ``"auto"`` (each block of the model's trunk), module-name patterns, or ``None``.
        sequence_parallel: Split the trunk's residual stream (norms, dropout) along the sequence too:
            activations between the TP regions shrink by 1/TP; the sequence length must divide by TP.
        start_method: ``"popen"`` (scripts, Hydra, torchrun, SLURM), ``"spawn"`` or ``"fork"``.
        process_group_backend: ``None`` (nccl on CUDA, gloo on CPU), or a backend name.
        timeout: Seconds a collective may wait before the job fails.
        **kwargs: Passed to :class:`ParallelEngineStrategy`.

    Example:
        >>> Trainer(devices=2, strategy=TensorParallelStrategy(plan={"model.blocks.*.mlp.fc_in": "colwise",
        ...                                                          "model.blocks.*.mlp.fc_out": "rowwise"}))  # doctest: +SKIP
    """

    preset_configs = {"tensor_parallel": TensorParallelConfig, "data_parallel": DataParallelConfig, "compilation": CompileConfig}
    # Split parameters are DTensors, which DDP cannot replicate: FSDP2 shards the TP group's replicas.
    preset_defaults = {"data_parallel_mode": "shard"}

    def __init__(self, tensor_parallel_size: int = -1, **options: Any) -> None:
        # Data-parallel replicas take whatever ranks remain; -1 for TP means "all ranks", so then dp is 1.
        layout = ParallelLayout(
            data_parallel_size=-1 if tensor_parallel_size != -1 else 1, tensor_parallel_size=tensor_parallel_size
        )
        super().__init__(layout=layout, **self.preset_options(options))
