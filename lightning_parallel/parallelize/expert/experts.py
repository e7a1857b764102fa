"""Routed experts found on an unmodified model and divided by expert index over the expert-parallel ranks.

transformers 5 keeps a MoE block's routed experts on one module as 3-D parameters whose dim 0 is the expert
(``gate_up_proj [E, 2·I, H]`` or ``up_proj``, ``down_proj [E, H, I]``, and biases ``[E, ...]``), called by the block
as ``experts(hidden_states, top_k_index, top_k_weights)`` after the router has chosen (Mixtral, Qwen2/3-MoE,
DeepSeek-V3, gpt-oss, OLMoE, ...). Expert parallelism needs nothing of their internal layout: every parameter is
sharded on dim 0 (a ``Shard(0)`` DTensor on the ``ep`` mesh, so that checkpoints and optimizers see each expert by
its global index) and during the call the module reads its local experts (``to_local()`` views, and its expert
count attributes set to the local count), runs its own forward — in the experts implementation the model chose —
on the tokens routed to them from the whole group (:func:`~.dispatch.dispatch_and_combine`).

The router, shared experts and everything dense keep the dense layout. No Lightning here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.parallelize.expert.dispatch import dispatch_and_combine
from lightning_parallel.parallelize.tensor.per_head import LocalView

#: The down projection's parameter name; the up projection is ``gate_up_proj`` (gated) or ``up_proj``.
_DOWN = "down_proj"
_UP_NAMES = ("gate_up_proj", "up_proj")


@dataclass(frozen=True)
class RoutedExperts:
    """One module's routed experts, as expert parallelism divides them.

    Attributes:
        num_experts: ``E``, the size of every parameter's dim 0.
        parameters: Names of the module's own parameters (each ``[E, ...]``).
        count_attributes: The module's integer attributes holding ``E`` (read by its forward as the expert
            count: set to the local count during the call).
    """

    num_experts: int
    parameters: tuple[str, ...]
    count_attributes: tuple[str, ...]


def routed_experts(module: nn.Module) -> RoutedExperts | str | None:
    """``module``'s routed experts; why they cannot be divided (``str``); ``None`` if it holds none (or a single
    expert, which every token uses: a shared expert kept in the same 3-D layout, Inkling's)."""
    params = dict(module.named_parameters(recurse=False))
    up = next((name for name in _UP_NAMES if name in params), None)
    if up is None or _DOWN not in params or params[up].dim() != 3 or params[_DOWN].dim() != 3:
        return None
    count = params[_DOWN].shape[0]
    if count == 1:
        return None  # one expert (a shared expert stored like routed ones) is never routed: it stays dense
    others = [f"{name} {list(p.shape)}" for name, p in params.items() if p.dim() == 0 or p.shape[0] != count]
    if others:
        return f"its parameters {', '.join(others)} are not one entry per expert (dim 0 = {count} experts)"
    nested = [f"{name} {list(p.shape)}" for name, p in module.named_parameters() if name not in params]
    if nested:
        # Ergo's post_expert_norm: a submodule's per-expert weights, indexed by the expert ids the forward is given.
        return (f"its submodules hold parameters ({', '.join(nested)}) that expert parallelism does not divide with "
                f"the experts, while the dispatch hands the forward this rank's local expert ids")
    attributes = tuple(
        name for name, value in vars(module).items()
        if "expert" in name.lower() and isinstance(value, int) and not isinstance(value, bool) and value == count
    )
    return RoutedExperts(count, tuple(params), attributes)


def find_routed_experts(module: nn.Module) -> dict[str, RoutedExperts | str]:
    """Every routed-experts module under ``module``: FQN -> what expert parallelism divides, or why it cannot."""
    found: dict[str, RoutedExperts | str] = {}
    for name, sub in module.named_modules():
        experts = routed_experts(sub)
        if experts is not None:
            found[name] = experts
    return found


def check_divisible(fqn: str, experts: RoutedExperts, expert_parallel_size: int) -> None:
    """Raise ``ValueError`` (naming the fix) where ``experts`` cannot be divided ``expert_parallel_size`` ways."""
    if experts.num_experts % expert_parallel_size:
        raise ValueError(
            f"{fqn}: its {experts.num_experts} experts are not divisible by expert_parallel_size={expert_parallel_size}. "
            f"Choose an expert_parallel_size that divides {experts.num_experts}."
        )


def shard_experts(fqn: str, module: nn.Module, experts: RoutedExperts, ep_mesh: Any) -> list[nn.Parameter]:
    """Keep only this rank's experts of ``module`` (``Shard(0)`` DTensors on ``ep_mesh``) and route its calls
    through the expert-parallel group. Returns the new parameters.

    Every rank must hold the same whole experts before (they are sliced, not scattered).
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    placed = []
    for name in experts.parameters:
        param = module._parameters[name]
        shard = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
        placed.append(module._parameters[name])
    local = LocalView(experts.parameters)
    module.register_forward_pre_hook(local.enter)
    module.register_forward_hook(local.leave, always_call=True)
    # An instance attribute shadows the class's forward: nn.Module.__call__ (and its hooks) call this one.
    module.forward = _ExpertParallelForward(fqn, module, experts, ep_mesh.get_group())
    return placed


class _ExpertParallelForward:
    """``experts(hidden_states, top_k_index, top_k_weights, ...)`` computed by the ranks holding each expert."""

    def __init__(self, fqn: str, module: nn.Module, experts: RoutedExperts, group: dist.ProcessGroup) -> None:
        self.fqn, self.experts, self.group = fqn, experts, group
        self.module_forward: Callable[..., Any] = type(module).forward.__get__(module)
        self.signature = inspect.signature(self.module_forward)
        self.local_count = experts.num_experts // dist.get_world_size(group)
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        bound = self.signature.bind(*args, **kwargs)
        names = list(bound.arguments)
        hidden, index, weights = (bound.arguments.get(name) for name in (names + [None] * 3)[:3])
        self._check(hidden, index, weights)
        rest = {name: bound.arguments[name] for name in names[3:]}
        shape = hidden.shape

        def run_local(tokens: Tensor, local_index: Tensor, ones: Tensor) -> Tensor:
            module = self.module
            saved = {name: getattr(module, name) for name in self.experts.count_attributes}
            for name in saved:
                setattr(module, name, self.local_count)
            try:
                # Positionally: the experts implementation the model chose may name them otherwise than the class does.
                return self.module_forward(tokens, local_index, ones, **rest)
            finally:
                for name, value in saved.items():
                    setattr(module, name, value)

        flat = hidden.reshape(-1, shape[-1])
        out = dispatch_and_combine(run_local, flat, index.reshape(flat.shape[0], -1),
                                   weights.reshape(flat.shape[0], -1), self.experts.num_experts, self.group)
        return out.reshape(shape)

    def _check(self, hidden: Any, index: Any, weights: Any) -> None:
        ok = (
            isinstance(hidden, Tensor) and isinstance(index, Tensor) and isinstance(weights, Tensor)
            and hidden.is_floating_point() and not index.is_floating_point() and weights.is_floating_point()
            and index.shape == weights.shape and hidden.dim() >= 1
            and hidden.numel() // hidden.shape[-1] == index.shape[0]
        )
        if not ok:
            found = ", ".join(
                f"{type(v).__name__}{list(v.shape) if isinstance(v, Tensor) else ''}" for v in (hidden, index, weights)
            )
            raise TypeError(
                f"{self.fqn}: expert parallelism calls routed experts as experts(hidden_states [T, H], top_k_index [T, k], "
                f"top_k_weights [T, k]) (transformers' convention), but {type(self.module).__name__} was called with "
                f"({found}). Use expert_parallel_size=1 for this model (tensor_parallel_size splits its experts instead)."
            )
