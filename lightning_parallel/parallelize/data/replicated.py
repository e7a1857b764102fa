"""Replicate a module over the data-parallel ranks with torch's DistributedDataParallel.

Pure transform: ``(module, process group, options) -> DDP module``. Strategies pass plain arguments;
nothing here reads Hydra or Lightning state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_parallel.measure.comm import CommStats, counting_comm_hook

log = logging.getLogger(__name__)

#: Gradient communication hooks selectable by name.
COMM_HOOKS: dict[str, str] = {
    "allreduce": "plain all-reduce of the averaged gradients (exact; the default)",
    "fp16": "gradients compressed to float16 for the all-reduce (half the bytes, lossy)",
    "bf16": "gradients compressed to bfloat16 for the all-reduce (NCCL only, lossy)",
    "powersgd": "PowerSGD low-rank compression after `powersgd_start_iter` exact steps (lossy)",
}


#: How data-parallel replicas hold the model, and the ZeRO stage each corresponds to.
DATA_PARALLEL_MODES: dict[str, str] = {
    "replicate": "every replica holds all parameters, gradients and optimizer state; gradients all-reduced "
    "(DDP; ZeRO stage 0)",
    "shard": "parameters, gradients and optimizer state sharded over the replicas, parameters gathered per "
    "block for forward/backward, gradients reduce-scattered (FSDP2 fully_shard; ZeRO stage 3, or stage 2 "
    "with reshard_after_forward=False)",
    "hybrid_shard": "sharded within groups of data_parallel_shard_size ranks (a node), replicated across "
    "groups (FSDP2 HSDP; ZeRO-3 inside a node, all-reduce between nodes)",
}


@dataclass(frozen=True)
class DataParallelConfig:
    """Options of the data-parallel dimension, as torch's DistributedDataParallel and FSDP2 name them.

    Args:
        mode: One of :data:`DATA_PARALLEL_MODES`.
        shard_size: With ``mode="hybrid_shard"``: ranks that shard one replica (``-1``: the data-parallel
            ranks of one node).
        reshard_after_forward: Sharded modes: free gathered parameters after forward and gather them again
            for backward (ZeRO-3, least memory); ``False`` keeps them until backward (ZeRO-2-like, less traffic).
        bucket_cap_mb: Gradient bucket size; larger buckets mean fewer, bigger all-reduces.
        find_unused_parameters: Tolerate parameters that get no gradient in some steps (costs a graph walk).
        static_graph: Promise that the set of used parameters never changes (enables optimizations).
        gradient_as_bucket_view: Let gradients alias the communication buckets (saves one gradient copy).
        comm_hook: Name of the gradient communication hook, one of :data:`COMM_HOOKS`.
        powersgd_rank: Rank of the low-rank approximation for ``comm_hook="powersgd"``.
        powersgd_start_iter: Exact all-reduce steps before PowerSGD compression starts (must be > 1:
            PowerSGD's error feedback needs a warm start).
    """

    # The presets' flat keywords name the dimension (strategies/options.py).
    mode: str = field(default="replicate", metadata={"option": "data_parallel_mode"})
    shard_size: int = field(default=-1, metadata={"option": "data_parallel_shard_size"})
    reshard_after_forward: bool = True
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    comm_hook: str = "allreduce"
    powersgd_rank: int = 1
    powersgd_start_iter: int = 1000

    def __post_init__(self) -> None:
        if self.mode not in DATA_PARALLEL_MODES:
            raise ValueError(f"data_parallel_mode={self.mode!r} is unknown. Choose one of: {', '.join(DATA_PARALLEL_MODES)}.")
        if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int) or (self.shard_size < 1 and self.shard_size != -1):
            raise ValueError(f"data_parallel_shard_size={self.shard_size!r} must be a positive int, or -1 (the ranks of one node).")
        if self.mode != "replicate" and self.comm_hook != "allreduce":
            raise ValueError(
                f"comm_hook={self.comm_hook!r} is a DDP gradient hook and only applies to data_parallel_mode='replicate' "
                f"(got {self.mode!r}). Set comm_hook='allreduce' or data_parallel_mode='replicate'."
            )
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(
                f"comm_hook={self.comm_hook!r} is unknown. Choose one of: {', '.join(COMM_HOOKS)}."
            )
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={self.bucket_cap_mb} must be positive (megabytes per gradient bucket).")
        if self.powersgd_rank < 1:
            raise ValueError(f"powersgd_rank={self.powersgd_rank} must be >= 1.")
        if self.powersgd_start_iter < 2:
            raise ValueError(
                f"powersgd_start_iter={self.powersgd_start_iter} must be >= 2: PowerSGD's error feedback needs at "
                f"least one exact all-reduce step first."
            )

    @property
    def is_sharded(self) -> bool:
        """Whether replicas shard the model state (FSDP2) rather than each holding all of it."""
        return self.mode != "replicate"

    def shard_size_for(self, data_parallel_size: int, tensor_parallel_size: int, devices_per_node: int) -> int:
        """:meth:`resolve_shard_size` on a mesh whose tensor-parallel peers are adjacent, then the dp ranks:
        a node of ``devices_per_node`` devices holds ``devices_per_node // tensor_parallel_size`` dp ranks."""
        per_node = max(1, min(data_parallel_size, devices_per_node // tensor_parallel_size))
        return self.resolve_shard_size(data_parallel_size, per_node)

    def resolve_shard_size(self, data_parallel_size: int, data_parallel_per_node: int) -> int:
        """Ranks each replica's state is sharded over: 1 (replicate), all (shard), or a node's (hybrid_shard).

        Raises:
            ValueError: The shard size does not divide the data-parallel size.
        """
        if self.mode == "replicate":
            return 1
        if self.mode == "shard":
            return data_parallel_size
        size = data_parallel_per_node if self.shard_size == -1 else self.shard_size
        if size < 1 or data_parallel_size % size != 0:
            raise ValueError(
                f"data_parallel_mode='hybrid_shard' shards over data_parallel_shard_size={size} ranks, which must divide "
                f"data_parallel_size={data_parallel_size}. Choose a shard size that divides it (e.g. the GPUs of a node)."
            )
        return size

    def check_backend(self, backend: str) -> None:
        """Reject hooks the process-group backend cannot run, before any model is wrapped."""
        if self.comm_hook == "bf16" and backend != "nccl":
            raise ValueError(
                f"comm_hook='bf16' needs the NCCL backend (CUDA), but the process group uses {backend!r}. "
                f"Use comm_hook='fp16' for compressed gradients on CPU/gloo."
            )

    def check_accumulation(self, accumulate_grad_batches: int) -> None:
        """Reject option combinations that DDP gets wrong under gradient accumulation."""
        if self.static_graph and accumulate_grad_batches > 1:
            # torch's reducer asserts on the first no_sync() backward with a static graph, and once past that
            # stops all-reducing (pytorch/pytorch#143580, fix pending in #187732): refuse rather than risk it.
            raise ValueError(
                f"static_graph=True cannot be combined with accumulate_grad_batches={accumulate_grad_batches}: "
                f"torch's DDP mishandles skipped synchronization with a static graph. Set static_graph=False "
                f"(or accumulate_grad_batches=1)."
            )


def apply_ddp(
    module: nn.Module,
    process_group: dist.ProcessGroup,
    config: DataParallelConfig,
    device_ids: list[int] | None = None,
    comm_stats: CommStats | None = None,
) -> DistributedDataParallel:
    """Wrap ``module`` in DistributedDataParallel over ``process_group`` and register the comm hook.

    Args:
        module: The module to replicate; it must already live on its device.
        process_group: The data-parallel group (replicas that average their gradients).
        config: DDP options and the communication hook.
        device_ids: ``[cuda index]`` on GPU, ``None`` on CPU.
        comm_stats: If given, every gradient bucket the hook sends is counted into it.
    """
    ddp = DistributedDataParallel(
        module,
        device_ids=device_ids,
        process_group=process_group,
        bucket_cap_mb=config.bucket_cap_mb,
        find_unused_parameters=config.find_unused_parameters,
        static_graph=config.static_graph,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
    )
    state, hook = _resolve_comm_hook(config, process_group)
    if comm_stats is not None:
        hook = counting_comm_hook(hook, comm_stats)
    elif config.comm_hook == "allreduce":
        # No hook to register: DDP's built-in C++ all-reduce is the fastest path.
        return ddp
    ddp.register_comm_hook(state, hook)
    log.debug("DDP over %d ranks with comm hook %s", dist.get_world_size(process_group), config.comm_hook)
    return ddp


def _resolve_comm_hook(config: DataParallelConfig, process_group: dist.ProcessGroup) -> tuple[Any, Callable]:
    if config.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=config.powersgd_rank,
            start_powerSGD_iter=config.powersgd_start_iter,
        )
        return state, powerSGD_hook.powerSGD_hook
    hooks = {
        "allreduce": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": default_hooks.bf16_compress_hook,
    }
    return process_group, hooks[config.comm_hook]


def unwrap_ddp(module: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or the module itself)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of all trainable parameters' gradients: what one exact all-reduce round moves per rank."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


