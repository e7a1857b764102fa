"""The engine's data-parallel part: replicate (DDP) or shard (FSDP2/HSDP), activation checkpointing, accumulation.

Mixed into :class:`~lightning_parallel.strategies.engine.ParallelEngineStrategy`, which provides ``layout``,
``device_mesh``, ``root_device``, ``model``, ``lightning_module``, ``precision_plugin``, ``num_processes``,
``num_nodes``, ``world_size``, ``data_parallel_group``, ``_data_parallel`` (the config),
``_activation_checkpointing``, ``_checkpointed``, ``_sharded_units``, ``_accumulating``,
``_sync`` (periodic synchronization config), ``_periodic_sync`` and ``_comm_stats``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torchmetrics import Metric
from typing_extensions import override

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallelize.checkpointing import (
    apply_activation_checkpointing,
    checkpoint_targets,
)
from lightning_parallel.parallelize.data import apply_ddp
from lightning_parallel.parallelize.grad_sync import average_gradients
from lightning_parallel.parallelize.periodic_sync import PeriodicSync
from lightning_parallel.parallelize.sharded import (
    set_gradient_sync,
    shard_over_data_parallel,
)
from lightning_parallel.strategies.precision import fsdp_mixed_precision


class DataParallelStepsMixin:
    """How replicas hold and synchronize the model (outside pipelines, whose stages reduce gradients themselves)."""

    @property
    def _is_sharded(self) -> bool:
        """Whether parameters are DTensors (split by TP, or sharded over dp by FSDP2)."""
        return self.layout.tensor_parallel_size > 1 or self._shards_data_parallel

    @property
    def _shards_data_parallel(self) -> bool:
        return self.layout.data_parallel_size > 1 and self._data_parallel.is_sharded


    def _check_data_parallel_layout(self, layout: ParallelLayout) -> None:
        """Refuse, before any process starts, data-parallel settings the layout cannot run; warn about slow ones."""
        if self._sync.is_periodic:
            unsupported = [f"{name}={size}" for name, size in (("tensor_parallel_size", layout.tensor_parallel_size),
                           ("pipeline_parallel_size", layout.pipeline_parallel_size)) if size > 1]
            if self._data_parallel.is_sharded:
                unsupported.append(f"data_parallel_mode={self._data_parallel.mode!r}")
            if unsupported:
                raise ValueError(
                    f"sync={self._sync.method!r} averages whole replicated models and does not combine with "
                    f"{', '.join(unsupported)} yet. Use sync='every_step', or plain replicated data parallelism."
                )
        if layout.pipeline_parallel_size > 1 and self._shards_data_parallel:
            raise ValueError(
                f"data_parallel_mode={self._data_parallel.mode!r} is not supported with pipeline_parallel_size="
                f"{layout.pipeline_parallel_size} yet: pipeline stages' replicas replicate (one gradient all-reduce per "
                f"optimizer step). Set data_parallel_mode='replicate'."
            )
        tp = layout.tensor_parallel_size
        if tp > 1 and self.num_nodes > 1 and (tp > self.num_processes or self.num_processes % tp != 0):
            rank_zero_warn(
                f"tensor_parallel_size={tp} does not divide the {self.num_processes} devices per node: some tensor-parallel "
                f"groups span nodes, and their all-reduces (every layer, forward and backward) cross the slow inter-node "
                f"link. Use a tensor_parallel_size that divides the devices per node."
            )

    def _apply_activation_checkpointing(self) -> None:
        if not self._activation_checkpointing or self._checkpointed is not None:
            return
        module = self.lightning_module
        self._checkpointed = apply_activation_checkpointing(module, checkpoint_targets(module, self._activation_checkpointing))
        rank_zero_info(f"lightning_parallel: activation checkpointing of {', '.join(self._checkpointed)}")

    def _apply_data_parallel(self) -> None:
        if self.layout.data_parallel_size == 1:
            return
        if self._is_sharded:
            # Sharded replicas, or DTensor parameters (which DDP cannot take): FSDP2 over the dp dimensions.
            if not self._sharded_units:
                if self.layout.tensor_parallel_size == 1:
                    # FSDP2 shards each rank's own copy (DDP would broadcast rank 0's): start all from rank 0's
                    # weights. (Tensor parallelism synced them before splitting.)
                    _sync_module_states(self.lightning_module)
                self._sharded_units = shard_over_data_parallel(
                    self.lightning_module,
                    self.device_mesh["dp_replicate", "dp_shard"],
                    reshard_after_forward=self._data_parallel.reshard_after_forward,
                    mp_policy=fsdp_mixed_precision(self.precision_plugin),
                )
            return
        if self._sync.is_periodic:
            # Replicas step on their own gradients: no DDP. They start from rank 0's weights.
            _sync_module_states(self.lightning_module)
            self._periodic_sync = PeriodicSync(self._sync, list(self.lightning_module.parameters()), self.data_parallel_group)
            return
        device_ids = None if self.root_device.type == "cpu" else [self.root_device.index]
        self.model = apply_ddp(self.model, self.data_parallel_group, self._data_parallel, device_ids, self._comm_stats)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        sync = self._periodic_sync
        if sync is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        step = self.lightning_module.trainer.global_step  # optimizer steps done before this one
        parameters = sync.parameters

        def closure_then_average() -> Any:
            result = closure()  # the last micro-batch's backward: gradients are complete
            if sync.averages_gradients(step):
                start = time.perf_counter()
                sent = average_gradients(parameters, self.data_parallel_group)
                self._record_sync(sent, time.perf_counter() - start)
            return result

        output = super().optimizer_step(optimizer, closure_then_average, model, **kwargs)
        start = time.perf_counter()
        sent = sync.after_optimizer_step(step + 1)
        if sent:
            self._record_sync(sent, time.perf_counter() - start)
        return output

    def _record_sync(self, sent: int, seconds: float) -> None:
        if self._comm_stats is not None:
            self._comm_stats.record_round(sent, seconds=seconds)

    def _reduce_metrics_over_data_parallel(self) -> None:
        # torchmetrics sync over the whole world by default; TP/PP peers hold the same samples, so
        # metrics must reduce over the data-parallel replicas only.
        if self.layout.data_parallel_size == self.world_size:
            return
        for module in self.lightning_module.modules():
            if isinstance(module, Metric) and module.process_group is None:
                module.process_group = self.data_parallel_group

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip gradient synchronization while Lightning accumulates micro-batches (DDP and FSDP2)."""
        self._accumulating = True
        try:
            if self._sharded_units:
                set_gradient_sync(self._sharded_units, False)
                try:
                    yield
                finally:
                    set_gradient_sync(self._sharded_units, True)
            else:
                with super().block_backward_sync():
                    yield
        finally:
            self._accumulating = False
