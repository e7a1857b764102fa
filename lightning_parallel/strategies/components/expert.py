"""Expert parallelism in the engine: a Mixture-of-Experts model's routed experts divided over ``ep`` ranks.

The transforms are :mod:`lightning_parallel.parallelize.expert`; this component decides when they apply
(``expert_parallel_size > 1``), refuses what they cannot combine with yet, and reduces the experts' gradients
once per optimizer step (after the last accumulated micro-batch) over the ranks that hold the same experts.
Data parallelism leaves the experts to it (DDP and FSDP2 ignore them): they are replicated over the ranks holding
the same experts, whatever the data-parallel mode does with the dense parameters.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_parallel.layout import ParallelLayout, expert_meshes
from lightning_parallel.parallelize.expert.experts import (
    RoutedExperts,
    check_divisible,
    find_routed_experts,
    shard_experts,
)
from lightning_parallel.parallelize.expert.gradients import reduce_expert_gradients
from lightning_parallel.strategies.components.base import Component

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost


class ExpertParallelComponent(Component):
    """Divides every routed-experts module by expert index over the ``ep`` ranks (see
    :mod:`~lightning_parallel.parallelize.expert`)."""

    def __init__(self, engine: EngineHost) -> None:
        super().__init__(engine)
        #: Names (relative to the LightningModule) of the sharded expert parameters, once applied.
        self.parameter_names: tuple[str, ...] = ()
        self._parameters: list[nn.Parameter] = []
        self._replicas: dist.ProcessGroup | None = None

    @property
    def enabled(self) -> bool:
        return self.engine.layout.expert_parallel_size > 1

    @property
    def held_parameters(self) -> tuple[nn.Parameter, ...]:
        """This rank's expert parameters (``Shard(0)`` DTensors on the ep mesh), once applied: data parallelism
        leaves them to this component."""
        return tuple(self._parameters)

    def validate(self, layout: ParallelLayout) -> None:
        ep = layout.expert_parallel_size
        if ep == 1:
            return
        engine = self.engine
        refused = []
        for size, name in ((layout.pipeline_parallel_size, "pipeline_parallel_size"),
                           (layout.context_parallel_size, "context_parallel_size")):
            if size > 1:
                refused.append((f"{name}={size}", f"{name}=1"))
        if engine.data_parallel.sync.is_periodic:
            refused.append((f"sync={engine.data_parallel.sync.method!r}", "sync='every_step'"))
        if engine.data_parallel.config.comm_hook != "allreduce":
            refused.append((f"comm_hook={engine.data_parallel.config.comm_hook!r}", "comm_hook='allreduce'"))
        if refused:
            raise ValueError(
                f"expert_parallel_size={ep} does not combine with {', '.join(n for n, _ in refused)} yet. "
                f"Set {', '.join(f for _, f in refused)}, or expert_parallel_size=1 (tensor_parallel_size splits "
                f"experts too)."
            )

    def apply(self, trainer: Trainer, fitting: bool) -> None:
        if not self.enabled or self._parameters:
            return
        engine = self.engine
        module = engine.lightning_module
        ep = engine.layout.expert_parallel_size
        found = find_routed_experts(module)
        if not found:
            raise ValueError(
                f"expert_parallel_size={ep}, but {type(module).__name__} holds no routed experts (a module with 3-D "
                f"gate_up_proj or up_proj and down_proj parameters, one entry per expert, as transformers' "
                f"Mixture-of-Experts models keep them). Set expert_parallel_size=1."
            )
        refused = {fqn: reason for fqn, reason in found.items() if isinstance(reason, str)}
        if refused:
            fqn, reason = next(iter(refused.items()))
            raise ValueError(f"{fqn}: its experts cannot be divided over expert-parallel ranks: {reason}. Set expert_parallel_size=1.")
        experts: dict[str, RoutedExperts] = found  # type: ignore[assignment]
        for fqn, routed in experts.items():
            check_divisible(fqn, routed, ep)
        ep_mesh, replicas = expert_meshes(engine.device_mesh, ep)
        self._replicas = replicas.get_group() if replicas.size() > 1 else None
        modules = dict(module.named_modules())
        names = []
        for fqn, routed in experts.items():
            self._same_experts_everywhere(modules[fqn], routed)
            self._parameters += shard_experts(fqn, modules[fqn], routed, ep_mesh)
            names += [f"{fqn}.{name}" for name in routed.parameters]
        self.parameter_names = tuple(names)
        # DDP (and Lightning's weight sync outside fitting) leaves them alone: this component reduces their gradients.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(names))
        held = sum(p.to_local().numel() for p in self._parameters)
        rank_zero_info(
            f"Expert parallelism: {len(experts)} MoE layer(s), {next(iter(experts.values())).num_experts} experts each, "
            f"divided over ep={ep} ranks ({held} expert parameters on this rank)."
        )

    def _same_experts_everywhere(self, module: nn.Module, routed: RoutedExperts) -> None:
        """Every rank keeps its slice of the experts it built: start them all from data-parallel rank 0's."""
        group = self.engine.data_parallel_group
        for name in routed.parameters:
            param = module._parameters[name]
            if param.device.type != "meta":  # on meta each rank materialises its slice by replaying the init
                with torch.no_grad():
                    dist.broadcast(param.data, group=group, group_src=0)

    def after_backward(self, accumulating: bool) -> None:
        if accumulating or not self._parameters:
            return
        engine = self.engine
        start = time.perf_counter()
        sent = reduce_expert_gradients(self._parameters, self._replicas, engine.layout.data_parallel_size)
        if sent:
            engine.record_gradient_round(sent, time.perf_counter() - start)

