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

from lightning_parallel import collectives
from lightning_parallel.layout import ParallelLayout, expert_meshes, replica_mesh
from lightning_parallel.parallelize.expert.experts import (
    RoutedExperts,
    check_divisible,
    find_routed_experts,
    shard_experts,
)
from lightning_parallel.parallelize.expert.gradients import reduce_expert_gradients
from lightning_parallel.parallelize.common.expert_lists import ExpertList, find_expert_lists
from lightning_parallel.parallelize.expert.module_list import RemoteExpert, divide_expert_list
from lightning_parallel.parallelize.placement.deferred_init import allocate_local, has_meta_tensors
from lightning_parallel.strategies.components.base import Component

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost


class ExpertParallelComponent(Component):
    """Divides every routed-experts module (transformers' fused 3-D experts, and experts kept as an ``nn.ModuleList``)
    by expert index over the ``ep`` ranks (see :mod:`~lightning_parallel.parallelize.expert`)."""

    def __init__(self, engine: EngineHost) -> None:
        super().__init__(engine)
        #: Names (relative to the LightningModule) of the sharded expert parameters, once applied.
        self.parameter_names: tuple[str, ...] = ()
        self._parameters: list[nn.Parameter] = []
        self._replicas: dist.ProcessGroup | None = None
        self._experts: dict[str, RoutedExperts] = {}
        #: MoE blocks whose experts are an nn.ModuleList (list FQN -> what is divided), once applied.
        self.expert_lists: dict[str, ExpertList] = {}
        self._list_group: dist.ProcessGroup | None = None
        self._remote_shapes: dict[str, tuple[int, ...]] = {}

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
        if not self.enabled or self._experts or self.expert_lists:
            return
        engine = self.engine
        module = engine.lightning_module
        ep = engine.layout.expert_parallel_size
        found = find_routed_experts(module)
        lists = find_expert_lists(module)
        if not found and not lists:
            raise ValueError(
                f"expert_parallel_size={ep}, but {type(module).__name__} holds no routed experts: neither a module with "
                f"3-D gate_up_proj or up_proj and down_proj parameters, one entry per expert (transformers 5's layout), "
                f"nor an nn.ModuleList of two or more identical experts beside a router (a parameter of the block with "
                f"one dim per expert). Set expert_parallel_size=1."
            )
        refused = {fqn: reason for fqn, reason in found.items() if isinstance(reason, str)}
        if refused:
            fqn, reason = next(iter(refused.items()))
            raise ValueError(f"{fqn}: its experts cannot be divided over expert-parallel ranks: {reason}. Set expert_parallel_size=1.")
        experts: dict[str, RoutedExperts] = found  # type: ignore[assignment]
        for fqn, routed in experts.items():
            check_divisible(fqn, routed, ep)
        if lists:
            self._check_lists(lists)
        self._experts, self.expert_lists = experts, lists
        if engine.pipeline_parallel.enabled:
            return  # the pipeline is cut on the first batch: each rank divides its stages' experts then
        modules = dict(module.named_modules())
        self._divide({fqn: modules[fqn] for fqn in experts}, broadcast=True)

    def _check_lists(self, lists: dict[str, ExpertList]) -> None:
        """Refuse what nn.ModuleList experts do not combine with yet (their block runs twice, see
        :mod:`~lightning_parallel.parallelize.expert.module_list`)."""
        engine, ep = self.engine, self.engine.layout.expert_parallel_size
        for fqn, listed in lists.items():
            if listed.num_experts % ep:
                raise ValueError(
                    f"{fqn}: its {listed.num_experts} experts are not divisible by expert_parallel_size={ep}. "
                    f"Choose an expert_parallel_size that divides {listed.num_experts}."
                )
        first = next(iter(lists))
        layout = engine.layout
        if layout.pipeline_parallel_size > 1 and layout.tensor_parallel_size * layout.context_parallel_size > 1:
            raise ValueError(
                f"{first}: experts kept as an nn.ModuleList are divided by expert parallelism inside pipelines without "
                f"tensor or context parallelism only (tensor_parallel_size={layout.tensor_parallel_size}, "
                f"context_parallel_size={layout.context_parallel_size} with pipeline_parallel_size="
                f"{layout.pipeline_parallel_size}). Set those two to 1, or pipeline_parallel_size=1, or "
                f"expert_parallel_size=1."
            )
        if any(has_meta_tensors(engine.lightning_module.get_submodule(fqn)) for fqn in lists):
            raise ValueError(
                f"{first}: experts kept as an nn.ModuleList cannot be divided while on the meta device yet (each rank "
                f"would initialise its experts on its own). Build the model without trainer.init_module(empty_init=True), "
                f"or set expert_parallel_size=1."
            )

    def parameter_names_under(self, root: str) -> tuple[str, ...]:
        """The routed experts' parameter names relative to the submodule ``root`` (``""``: the LightningModule)
        that the pipeline cuts; a module built on the meta device keeps them there until they are divided."""
        prefix = f"{root}." if root else ""
        return tuple(
            f"{fqn}.{name}".removeprefix(prefix)
            for fqn, routed in self._experts.items() if fqn.startswith(prefix)
            for name in routed.parameters
        )

    def divide_stage_experts(self) -> dict[int, nn.Parameter | None]:
        """Under pipeline parallelism, once the stages are cut: divide the experts of this rank's stages.

        Returns ``id(whole parameter) -> its expert-parallel replacement``, for the stages and the optimizers to adopt.
        """
        if not self.enabled or self._parameters:
            return {}
        module = self.engine.lightning_module
        held = {
            fqn: module.get_submodule(fqn) for fqn, routed in self._experts.items()
            if all(module.get_submodule(fqn)._parameters[name] is not None for name in routed.parameters)
        }
        whole = {fqn: [sub._parameters[name] for name in self._experts[fqn].parameters] for fqn, sub in held.items()}
        # nn.ModuleList experts of this rank's stages (the cut set the other stages' parameters to None): the others
        # held by other ep ranks leave the stages and the optimizers (their blocks' operators bind None for them).
        lists = {fqn: listed for fqn, listed in self.expert_lists.items() if _on_this_rank(module.get_submodule(fqn))}
        listed_before = {fqn: list(module.get_submodule(fqn).parameters()) for fqn in lists}
        self._divide(held, broadcast=False, lists=lists)  # the pipeline started every rank from rank 0's weights
        for sub in held.values():
            if has_meta_tensors(sub):  # built on the meta device, kept there by the cut: memory for this rank's experts
                allocate_local(sub, self.engine.root_device)
        kept = {id(p) for p in self._parameters}
        replaced: dict[int, nn.Parameter | None] = {
            id(old): sub._parameters[name]
            for fqn, sub in held.items()
            for old, name in zip(whole[fqn], self._experts[fqn].parameters)
        }
        replaced.update({id(p): None for params in listed_before.values() for p in params if id(p) not in kept})
        return replaced

    def _divide(self, modules: dict[str, nn.Module], broadcast: bool, lists: dict[str, ExpertList] | None = None) -> None:
        engine = self.engine
        ep = engine.layout.expert_parallel_size
        ep_mesh, replicas = expert_meshes(engine.device_mesh, ep)
        self._replicas = _gradient_peers(engine, replicas)
        names, buffers = [], []
        for fqn, sub in modules.items():
            routed = self._experts[fqn]
            if broadcast:
                self._same_experts_everywhere(sub, routed)
            self._parameters += shard_experts(fqn, sub, routed, ep_mesh)
            names += [f"{fqn}.{name}" for name in routed.parameters]
        lists = self.expert_lists if lists is None else lists
        for fqn, listed in lists.items():
            self._parameters += self._divide_list(listed, ep_mesh.get_group())
            rank, local = ep_mesh.get_local_rank(), listed.num_experts // ep
            kept = range(rank * local, (rank + 1) * local)
            names += listed.parameter_names(kept)
            experts = engine.lightning_module.get_submodule(listed.fqn)
            buffers += [f"{listed.fqn}.{i}.{name}" for i in kept for name, _ in experts[i].named_buffers()]
        self.parameter_names = tuple(names)
        # DDP (and Lightning's weight sync outside fitting) leaves them alone: this component reduces their gradients
        # (and each rank holds the buffers of its own experts only).
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(engine.lightning_module, list(names) + buffers)
        held = sum(getattr(p, "_local_tensor", p).numel() for p in self._parameters)
        counts = sorted({e.num_experts for e in (*self._experts.values(), *self.expert_lists.values())})
        rank_zero_info(
            f"Expert parallelism: {len(modules) + len(lists)} MoE layer(s) here of "
            f"{len(self._experts) + len(self.expert_lists)}, {'/'.join(map(str, counts))} experts each, divided over "
            f"ep={ep} ranks ({held} expert parameters on this rank)."
        )

    @property
    def list_group(self) -> dist.ProcessGroup | None:
        """Where nn.ModuleList experts are divided: the expert-parallel group whose ranks hold different experts
        (each by its global name), over which checkpoints gather them; ``None``: no such experts."""
        return self._list_group

    @property
    def divided_apart(self) -> tuple[tuple[nn.Parameter, ...], dist.ProcessGroup] | None:
        """``(this rank's nn.ModuleList expert parameters, the ep group)``: parameters whose gradient norm shares
        are summed over the group (each rank holds other experts); ``None``: no such experts."""
        if self._list_group is None:
            return None
        module = self.engine.lightning_module
        prefixes = tuple(f"{fqn}." for fqn in self.expert_lists)
        return tuple(p for name, p in module.named_parameters() if name.startswith(prefixes)), self._list_group

    def whole_order(self, names: list[str]) -> list[str]:
        """``names`` (parameter names of the whole model) in the whole model's order: the nn.ModuleList experts that
        other ranks hold in their list's place, by index (the order an optimizer over the whole model lists them)."""
        order: dict[str, int] = {}
        lists = {f"{fqn}.": listed for fqn, listed in self.expert_lists.items()}
        for name, _ in self.engine.lightning_module.named_parameters():
            prefix = next((p for p in lists if name.startswith(p)), None)
            if prefix is None:
                order.setdefault(name, len(order))
            elif f"{prefix}0.{lists[prefix].parameters[0]}" not in order:
                for whole in lists[prefix].parameter_names(range(lists[prefix].num_experts)):
                    order.setdefault(whole, len(order))
        return sorted(names, key=lambda n: order.get(n, len(order)))

    @property
    def remote_expert_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of the state-dict entries of the nn.ModuleList experts other ranks hold."""
        return dict(self._remote_shapes)

    def _divide_list(self, listed: ExpertList, group: dist.ProcessGroup) -> list[nn.Parameter]:
        """Start every rank from data-parallel rank 0's experts, then keep this rank's (see :mod:`module_list`)."""
        experts = self.engine.lightning_module.get_submodule(listed.fqn)
        with torch.no_grad():
            collectives.broadcast_coalesced([*experts.parameters(), *experts.buffers()], self.engine.data_parallel_group)
        # Every expert has the first one's state-dict entries (found structurally identical).
        shapes = {name: tuple(t.shape) for name, t in experts[0].state_dict().items()}
        kept = divide_expert_list(self.engine.lightning_module, listed, group)
        self._list_group = group
        self._remote_shapes.update({
            f"{listed.fqn}.{i}.{name}": shape
            for i in range(listed.num_experts) if isinstance(experts[i], RemoteExpert)
            for name, shape in shapes.items()
        })
        return kept

    def _same_experts_everywhere(self, module: nn.Module, routed: RoutedExperts) -> None:
        """Every rank keeps its slice of the experts it built: start them all from data-parallel rank 0's."""
        params = [module._parameters[name] for name in routed.parameters]
        # On meta each rank materialises its slice by replaying the init.
        with torch.no_grad():
            collectives.broadcast_coalesced([p for p in params if p.device.type != "meta"], self.engine.data_parallel_group)

    def after_backward(self, accumulating: bool) -> None:
        if accumulating or not self._parameters:
            return
        engine = self.engine
        start = time.perf_counter()
        # Context-parallel peers hold other parts of the same sequences: their gradients join the average.
        divide_by = engine.layout.data_parallel_size * engine.layout.context_parallel_size
        sent = reduce_expert_gradients(self._parameters, self._replicas, divide_by)
        if sent:
            engine.record_gradient_round(sent, time.perf_counter() - start)



def _on_this_rank(experts: nn.Module) -> bool:
    """Whether a pipeline's cut left ``experts`` (an nn.ModuleList) on this rank's stages: their parameters are
    ``None`` on the other ranks."""
    return next(experts.parameters(), None) is not None


def _gradient_peers(engine: EngineHost, replicas: object) -> dist.ProcessGroup | None:
    """The ranks whose expert gradients sum into this rank's: those holding the same experts (every ``ep``-th
    data-parallel rank) and, under context parallelism, each of their context-parallel peers. ``None``: no other."""
    layout = engine.layout
    cp = layout.context_parallel_size
    if cp == 1:
        return replicas.get_group() if replicas.size() > 1 else None
    dp_cp = replica_mesh(engine.device_mesh)  # (dp_replicate, dp_shard, cp) flattened: dp-major, cp-minor
    ep = layout.expert_parallel_size
    # DeviceMesh._unflatten is private (checked against torch 2.13): as in layout.expert_meshes.
    split = dp_cp._unflatten(0, (layout.data_parallel_size // ep, ep, cp), ("ep_replicas", "ep", "cp"))
    return split["ep_replicas", "cp"]._flatten("ep_replicas_cp").get_group()
