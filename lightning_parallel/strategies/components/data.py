"""Data parallelism in the engine: replicate (DDP), shard (FSDP2 / HSDP) or synchronize periodically.

Pipeline stages hold their own parameters; their replicas average (or, sharded, reduce-scatter) gradients in the
pipeline component (once per optimizer step), so none of the wrapping here applies under
``pipeline_parallel_size > 1``. The check for buffers that differ between replicas does.
"""

from __future__ import annotations

import time
from dataclasses import replace
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lightning.pytorch.utilities.exceptions import _augment_message
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torchmetrics import Metric

from lightning_parallel.collectives import sync_module_states
from lightning_parallel.layout import ParallelLayout, replica_mesh
from lightning_parallel.measure.collectives import outside_training
from lightning_parallel.parallelize.common.expert_lists import find_expert_lists
from lightning_parallel.parallelize.data.batchnorm import (
    batch_statistics_layers,
    convert_sync_batchnorm,
    replica_divergent_buffers,
    revert_sync_batchnorm,
    running_statistics_warning,
    unsynchronized_batchnorm_warning,
)
from lightning_parallel.parallelize.data.replicated import DataParallelConfig, apply_ddp
from lightning_parallel.parallelize.data.grad_sync import average_gradients
from lightning_parallel.parallelize.data.periodic_sync import PeriodicSync, SyncConfig
from lightning_parallel.parallelize.data.sharded import (
    count_communication,
    set_gradient_sync,
    shard_over_data_parallel,
)
from lightning_parallel.parallelize.expert.load_balancing import global_load_balancing, load_balancing_modules
from lightning_parallel.strategies.collectives import is_dry_run
from lightning_parallel.strategies.components.base import Component
from lightning_parallel.strategies.precision import fsdp_mixed_precision

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost


class DataParallelComponent(Component):
    """How replicas hold and synchronize the model over the ``dp`` axes.

    Args:
        engine: The strategy.
        config: Mode (replicate / shard / hybrid_shard) and the DDP and FSDP2 options.
        sync: How often replicas synchronize (every step, local SGD, DiLoCo).
        sync_batchnorm: BatchNorm statistics over the whole data-parallel batch.
    """

    def __init__(
        self, engine: EngineHost, config: DataParallelConfig, sync: SyncConfig, sync_batchnorm: bool
    ) -> None:
        super().__init__(engine)
        self.config = config
        self.sync = sync
        self.sync_batchnorm = sync_batchnorm
        self.periodic_sync: PeriodicSync | None = None
        self.sharded_units: list[nn.Module] = []
        self._batchnorm_converted = False
        self._buffer_checks = 0
        #: Buffers found to differ between replicas after one of the first training steps (named in a warning).
        self.divergent_buffers: list[str] = []
        self._balancing_modules: list[ModuleType] | None = None

    @property
    def shards(self) -> bool:
        """Whether replicas shard the model state over the data-parallel ranks (FSDP2)."""
        return self.engine.layout.data_parallel_size > 1 and self.config.is_sharded

    @property
    def uses_fsdp(self) -> bool:
        """Whether replicas are FSDP2 modules: sharded state, or tensor-parallel DTensor parameters (which DDP
        cannot take). Experts divided by expert parallelism are DTensors too, but DDP ignores them."""
        return self.shards or self.engine.tensor_parallel.enabled

    def validate(self, layout: ParallelLayout) -> None:
        """Refuse, before any process starts, data-parallel settings the layout cannot run; warn about slow ones."""
        if self.sync.is_periodic:
            unsupported = [f"{name}={size}" for name, size in (("tensor_parallel_size", layout.tensor_parallel_size),
                           ("pipeline_parallel_size", layout.pipeline_parallel_size)) if size > 1]
            if self.config.is_sharded:
                unsupported.append(f"data_parallel_mode={self.config.mode!r}")
            if unsupported:
                raise ValueError(
                    f"sync={self.sync.method!r} averages whole replicated models and does not combine with "
                    f"{', '.join(unsupported)} yet. Use sync='every_step', or plain replicated data parallelism."
                )
        if layout.pipeline_parallel_size > 1 and self.sync_batchnorm:
            raise ValueError(
                "sync_batchnorm=True is not supported with pipeline_parallel_size > 1 (a stage's batch statistics are "
                "its micro-batch's); set sync_batchnorm=False."
            )
        tp, per_node = layout.tensor_parallel_size, self.engine.num_processes
        if tp > 1 and self.engine.num_nodes > 1 and (tp > per_node or per_node % tp != 0):
            rank_zero_warn(
                f"tensor_parallel_size={tp} does not divide the {per_node} devices per node: some tensor-parallel "
                f"groups span nodes, and their all-reduces (every layer, forward and backward) cross the slow inter-node "
                f"link. Use a tensor_parallel_size that divides the devices per node."
            )

    def prepare(self, trainer: Trainer, fitting: bool) -> None:
        engine = self.engine
        if fitting and (self.sync_batchnorm or engine._layer_sync is not None):
            engine.model = convert_sync_batchnorm(engine.model, engine.data_parallel_group, engine.root_device.type)
            self._batchnorm_converted = True
        elif fitting and engine.layout.pipeline_parallel_size == 1:
            # (A pipeline refuses batch statistics per micro-batch on its own, before the first step.)
            model = engine.model
            message = unsynchronized_batchnorm_warning(
                batch_statistics_layers(model, training=True), type(model).__name__, engine.layout.data_parallel_size
            )
            if message is not None:
                rank_zero_warn(message)

    def apply(self, trainer: Trainer, fitting: bool) -> None:
        engine = self.engine
        if engine.layout.pipeline_parallel_size > 1:
            return
        if fitting:
            if self.config.static_graph and not engine.lightning_module.automatic_optimization:
                raise ValueError(
                    "static_graph=True is not supported with manual optimization (automatic_optimization=False): "
                    "Lightning cannot tell DDP when the first static-graph iteration ends. Set static_graph=False."
                )
            self.config.check_accumulation(trainer.accumulate_grad_batches)
            self._wrap()
        elif self.uses_fsdp:
            self._wrap()
        else:
            # No DDP wrapper outside fitting: make sure every rank evaluates the same weights.
            sync_module_states(engine.model, keep=engine.expert_parallel.held_parameters)
        self._reduce_metrics_over_data_parallel()

    def _wrap(self) -> None:
        engine = self.engine
        # Context-parallel peers hold the same weights too: gradients are averaged over dp × cp.
        if engine.layout.data_parallel_size * engine.layout.context_parallel_size == 1:
            return
        if self.uses_fsdp:
            # Sharded replicas, or DTensor parameters (which DDP cannot take): FSDP2 over the dp axes.
            if not self.sharded_units:
                if engine.layout.tensor_parallel_size == 1 and not engine.placement.deferred:
                    # FSDP2 shards each rank's own copy (DDP would broadcast rank 0's): start all from rank 0's
                    # weights. (Tensor parallelism synced them before splitting.)
                    sync_module_states(engine.lightning_module, keep=engine.expert_parallel.held_parameters)
                mesh = replica_mesh(engine.device_mesh, sharded=True)
                self.sharded_units = shard_over_data_parallel(
                    engine.lightning_module,
                    mesh,
                    reshard_after_forward=self.config.reshard_after_forward,
                    # bf16 copies gathered only where shards span ranks (replicas of tp shards: one-rank shards).
                    mp_policy=fsdp_mixed_precision(engine.precision_plugin, gathered=mesh.shape[-1] > 1),
                    ignored_params=set(engine.expert_parallel.held_parameters),
                )
                if engine.comm_stats is not None:
                    count_communication(self.sharded_units, engine.comm_stats)
            engine.placement.place()  # after sharding: only this rank's shards are allocated
            return
        if self.sync.is_periodic:
            # Replicas step on their own gradients: no DDP. They start from rank 0's weights.
            sync_module_states(engine.lightning_module, keep=engine.expert_parallel.held_parameters)
            self.periodic_sync = PeriodicSync(self.sync, list(engine.lightning_module.parameters()), engine.data_parallel_group)
            return
        device_ids = None if engine.root_device.type == "cpu" else [engine.root_device.index]
        engine.model = apply_ddp(engine.model, engine.replica_group, self._ddp_config(), device_ids, engine.comm_stats)

    def _ddp_config(self) -> DataParallelConfig:
        """The DDP options, with ``find_unused_parameters`` on where experts kept as an ``nn.ModuleList`` are replicated.

        Their block calls only the experts its tokens chose, so which experts get a gradient differs between
        replicas: DDP without ``find_unused_parameters`` then all-reduces its gradient buckets in a different order
        on each rank and hangs in the first backward. (Expert parallelism takes such experts out of DDP.)

        Raises:
            ValueError: ``static_graph=True`` with such experts (the graph changes with the routing).
        """
        config, engine = self.config, self.engine
        if config.find_unused_parameters or engine.layout.expert_parallel_size > 1:
            return config
        lists = find_expert_lists(engine.lightning_module)
        if not lists:
            return config
        names = ", ".join(lists)
        if config.static_graph:
            raise ValueError(
                f"static_graph=True, but {names} are experts kept as an nn.ModuleList, called only for the tokens routed "
                f"to them: which of them get a gradient differs between steps and replicas. Set static_graph=False."
            )
        rank_zero_info(
            f"lightning_parallel: DDP with find_unused_parameters=True: the experts of {names} get a gradient only "
            f"where a token chose them, which differs between replicas."
        )
        return replace(config, find_unused_parameters=True)

    def _reduce_metrics_over_data_parallel(self) -> None:
        # torchmetrics sync over the whole world by default; TP/PP peers hold the same samples, so
        # metrics must reduce over the data-parallel replicas only.
        engine = self.engine
        if engine.layout.data_parallel_size == engine.world_size:
            return
        for module in engine.lightning_module.modules():
            if isinstance(module, Metric) and module.process_group is None:
                module.process_group = engine.data_parallel_group

    def around_step(self, hook: str, run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with global_load_balancing(*self._load_balancing()):
            return self._check_buffers_after(hook, run)

    def _load_balancing(self) -> tuple[list[ModuleType], Any]:
        """The MoE modeling modules whose load-balancing loss is made global, and the ranks that split the batch
        (data-parallel replicas and context-parallel peers). Replicas that synchronize periodically train
        their own objective between syncs: each keeps its own loss there."""
        engine = self.engine
        layout = engine.layout
        if layout.data_parallel_size * layout.context_parallel_size == 1 or self.sync.method != "every_step":
            return [], None
        if self._balancing_modules is None:
            self._balancing_modules = load_balancing_modules(engine.lightning_module)
        if not self._balancing_modules:
            return [], None
        group = replica_mesh(engine.device_mesh).get_group() if layout.context_parallel_size > 1 else engine.data_parallel_group
        return self._balancing_modules, group

    #: Training steps after which buffers are compared between replicas. More than one: a statistic such as a
    #: running maximum can come out equal on every replica after one step by chance (the maximum of the global batch
    #: fell in rank 0's slice) and differ after the next.
    BUFFER_CHECK_STEPS = 4

    def _check_buffers_after(self, hook: str, run: Callable[[], Any]) -> Any:
        engine = self.engine
        # Context-parallel peers hold the same weights and see other parts of each sequence: statistics of what a
        # rank sees part ways between them as between data-parallel replicas.
        replicas = engine.layout.data_parallel_size * engine.layout.context_parallel_size
        if (hook != "training_step" or self._buffer_checks >= self.BUFFER_CHECK_STEPS
                or replicas == 1 or is_dry_run()):
            return run()
        # After each of the first training steps, buffers that differ between replicas are statistics of each one's
        # slice; every rank checks at the same steps (one small all-gather each).
        self._buffer_checks += 1
        output = run()
        module = engine.lightning_module
        with outside_training():
            divergent = replica_divergent_buffers(module, engine.replica_group)
        new = [name for name in divergent if name not in self.divergent_buffers]
        self.divergent_buffers += new
        message = running_statistics_warning(new, type(module).__name__, replicas)
        if message is not None:  # once per newly found set, not every step
            rank_zero_warn(message)
        return output

    def gradient_sync_blocked(self) -> AbstractContextManager[None]:
        return self._no_sync()

    @contextmanager
    def _no_sync(self) -> Generator[None, None, None]:
        """Skip gradient synchronization while Lightning accumulates micro-batches (DDP and FSDP2)."""
        model = self.engine.model
        if self.sharded_units:
            set_gradient_sync(self.sharded_units, False)
            try:
                yield
            finally:
                set_gradient_sync(self.sharded_units, True)
        elif isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            yield

    def around_optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], run: Callable[[Callable[[], Any]], Any]) -> Any:
        sync = self.periodic_sync
        if sync is None:
            return run(closure)
        engine = self.engine
        step = engine.lightning_module.trainer.global_step  # optimizer steps done before this one

        def closure_then_average() -> Any:
            result = closure()  # the last micro-batch's backward: gradients are complete
            if sync.averages_gradients(step):
                start = time.perf_counter()
                sent = average_gradients(sync.parameters, engine.data_parallel_group)
                engine.record_gradient_round(sent, time.perf_counter() - start)
            return result

        output = run(closure_then_average)
        start = time.perf_counter()
        sent = sync.after_optimizer_step(step + 1)
        if sent:
            engine.record_gradient_round(sent, time.perf_counter() - start)
        return output

    def on_exception(self, exception: BaseException) -> None:
        _augment_message(
            exception,
            pattern=".*Expected to have finished reduction in the prior iteration.*",
            new_message=(
                "Your LightningModule has parameters that did not take part in the loss returned by training_step. "
                "If that is intended, pass find_unused_parameters=True to the strategy "
                "(on the command line: strategy.find_unused_parameters=true)."
            ),
        )
        _augment_message(
            exception,
            pattern=".*Expected to mark a variable ready only once.*",
            new_message=(
                "A parameter of your LightningModule got its gradient outside the autograd graph DDP saw in forward "
                "(a custom autograd Function that recomputes its layer in backward: reversible layers, reentrant "
                "activation checkpointing), which DDP cannot follow with find_unused_parameters=True. If the model uses "
                "the same parameters every step, pass static_graph=True to the strategy instead (on the command line: "
                "strategy.static_graph=true strategy.find_unused_parameters=false)."
            ),
        )

    def teardown(self) -> None:
        engine = self.engine
        if isinstance(engine.model, DistributedDataParallel):
            engine.model = engine.lightning_module
        if self._batchnorm_converted and engine.model is not None:
            engine.model = revert_sync_batchnorm(engine.model)
            self._batchnorm_converted = False
