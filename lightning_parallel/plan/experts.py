"""Routed experts in a meta-device dry run: computed as if the router spread the tokens evenly.

An experts module's own forward picks each expert's tokens by data-dependent counts (``torch.where`` on the
router's choices), which the meta device cannot know (``nonzero`` has no meta kernel). For the dry run each
routed-experts module (:func:`~lightning_parallel.parallelize.expert.experts.find_routed_experts`) computes
instead what a balanced router costs: every expert gets ``⌈tokens × k / E⌉`` tokens, through its up and down
weights (one batched matmul each), so FLOPs, saved activations and gradients are those of training at even
load; its output keeps the gradient paths to the hidden states and the routing weights.

Experts kept as an ``nn.ModuleList`` (:func:`~lightning_parallel.parallelize.expert.module_list.find_expert_lists`)
are chosen by the MoE block's own loop, which indexes by values. There the block's forward runs once on the CPU
with random values (its parameters and buffers outside the experts, and its inputs, of the meta call's shapes), each
expert call recorded instead of computed: that gives the (token, choice) pairs a dropless router sends to the
experts, whatever its top-k or routing code. On the meta device the block then costs its router's matmul and each
expert run on ``⌈pairs / E⌉`` tokens; its output has the recorded shapes and keeps the gradient paths to the
hidden states, the router and every expert.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from lightning_parallel.parallelize.expert.experts import RoutedExperts, find_routed_experts
from lightning_parallel.parallelize.common.expert_lists import ExpertList, find_expert_lists, router_of

_UP_NAMES = ("gate_up_proj", "up_proj")


class RoutedTraffic:
    """What the routed experts of a dry run would send through expert parallelism's all-to-alls.

    Attributes:
        pair_bytes: Bytes of the hidden states of every (token, choice) pair entering routed experts, summed over
            the MoE layer calls of the step (one way, forward).
        calls: MoE layer calls in the step's forward.
        parameters: Full names (relative to the dry-run module) of the routed-experts parameters.
        counts: Routed experts per MoE layer (every count an expert-parallel size must divide).
        lists: Some MoE block keeps its experts as an ``nn.ModuleList``.
        dense: FQNs of experts modules called without routing (every expert on every token, Llama 4's
            ``experts(hidden_states)``): computed as the model computes them, not counted as routed, never divided.
        flops: The routed experts' own forward work (at even load; not the router's or a shared expert's), one entry
            per call: (the called module's FQN relative to the dry-run module, what ``where`` returned as it was
            called, FLOPs, bytes it saved for backward as ``saved`` counts them).
        where: Set by a dry run that tracks segments: the segment running now (``None`` otherwise).
        saved: Set by a dry run that tracks saved activations: the bytes saved for backward so far (0 otherwise).
    """

    def __init__(self) -> None:
        self.pair_bytes = 0.0
        self.calls = 0
        self.lists = False
        self.dense: set[str] = set()
        #: FQN of each patched experts module -> (its expert count, its parameters' full names).
        self.modules: dict[str, tuple[int, tuple[str, ...]]] = {}
        self.flops: list[tuple[str, Any, float, float]] = []
        self.where: Callable[[], Any] = lambda: None
        self.saved: Callable[[], float] = lambda: 0.0

    @property
    def parameters(self) -> set[str]:
        """Full names of the routed experts' parameters (experts called densely excluded)."""
        return {name for fqn, (_, names) in self.modules.items() if fqn not in self.dense for name in names}

    @property
    def counts(self) -> set[int]:
        """Routed experts per MoE layer (experts called densely excluded)."""
        return {count for fqn, (count, _) in self.modules.items() if fqn not in self.dense}

    @contextmanager
    def counting(self, fqn: str) -> Iterator[None]:
        """Record the FLOPs and saved activations of the block inside as routed experts' at ``fqn`` (nested: the dry
        run's own counter and tracker count them too)."""
        where, saved = self.where(), self.saved()
        with FlopCounterMode(display=False) as counter:
            yield
        self.flops.append((fqn, where, float(counter.get_total_flops()), self.saved() - saved))


@contextmanager
def balanced_routing(module: nn.Module) -> Iterator[RoutedTraffic]:
    """Within the block, every routed-experts module of ``module`` runs :class:`_BalancedExperts`; yields what
    they route."""
    patched, traffic = [], RoutedTraffic()
    for fqn, routed in find_routed_experts(module).items():
        if isinstance(routed, RoutedExperts):
            sub = module.get_submodule(fqn)
            sub.forward = _BalancedExperts(fqn, sub, routed, traffic)  # an instance attribute shadows the class's forward
            patched.append(sub)
            traffic.modules[fqn] = (routed.num_experts, tuple(f"{fqn}.{name}" if fqn else name for name in routed.parameters))
    for listed in find_expert_lists(module).values():
        block = module.get_submodule(listed.block)
        block.forward = _BalancedExpertList(block, listed, traffic)
        patched.append(block)
        traffic.modules[listed.block] = (listed.num_experts, tuple(listed.parameter_names(range(listed.num_experts))))
        traffic.lists = True
    try:
        yield traffic
    finally:
        for sub in patched:
            sub.__dict__.pop("forward", None)


class _BalancedExperts:
    def __init__(self, fqn: str, module: nn.Module, routed: RoutedExperts, traffic: RoutedTraffic) -> None:
        self.fqn, self.module, self.routed, self.traffic = fqn, module, routed, traffic

    def __call__(self, hidden: Tensor, top_k_index: Tensor | None = None, top_k_weights: Tensor | None = None,
                 *args: Any, **kwargs: Any) -> Tensor:
        if top_k_index is None or top_k_weights is None:
            # Not given the router's choices: every expert computes every token it is given (Llama 4), as the model
            # computes it (no data-dependent indexing); expert parallelism cannot divide such experts.
            self.traffic.dense.add(self.fqn)
            return type(self.module).forward(self.module, hidden, *[a for a in (top_k_index, top_k_weights) if a is not None],
                                             *args, **kwargs)
        module, experts = self.module, self.routed.num_experts
        up = next(getattr(module, name) for name in _UP_NAMES if name in self.routed.parameters)
        down = module.down_proj
        flat = hidden.reshape(-1, hidden.shape[-1])
        width = flat.shape[-1]
        pairs = flat.shape[0] * top_k_index.shape[-1]
        self.traffic.pair_bytes += pairs * width * flat.element_size()
        self.traffic.calls += 1
        per_expert = max(1, -(-pairs // experts))
        tokens = flat[:1].expand(per_expert, width).unsqueeze(0).expand(experts, per_expert, width)
        with self.traffic.counting(self.fqn):
            inner = torch.bmm(tokens, up.reshape(experts, width, -1))  # up[e]'s FLOPs per token, whatever its layout
            units = down[0].numel() // width
            out = torch.bmm(inner[..., :units], down.reshape(experts, units, width))
        # Shape of the real output; the gradient reaches the tokens, the weights and both projections.
        return flat + (out.sum() + top_k_weights.sum()) * 0


class _BalancedExpertList:
    """An MoE block whose experts are an ``nn.ModuleList``, as :class:`_BalancedExperts` for fused ones (see the
    module doc): the pairs and the other children's calls recorded by one CPU run of the block's own forward, the
    experts and those calls computed on meta."""

    def __init__(self, block: nn.Module, listed: ExpertList, traffic: RoutedTraffic) -> None:
        self.block, self.listed, self.traffic = block, listed, traffic
        self.experts: nn.ModuleList = getattr(block, listed.attribute)
        router = router_of(block, self.experts)
        assert router is not None  # found with its router
        self.router = router
        #: (input shapes) -> (pairs, expert input width, output, other children's calls): one CPU run per shape.
        self._seen: dict[Any, tuple[int, int, Any, list[tuple[str, Any]]]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = tree_map(lambda t: (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else t, (args, kwargs))
        key = repr(key)
        if key not in self._seen:
            self._seen[key] = self._count(args, kwargs)
        pairs, width, shapes, children = self._seen[key]
        hidden = next(t for t in _tensors((args, kwargs)) if t.is_floating_point())
        flat = hidden.reshape(-1, hidden.shape[-1])
        self.traffic.pair_bytes += pairs * width * hidden.element_size()
        self.traffic.calls += 1
        # The block's other children, once per recorded call (the router's Linear, a shared expert, its gate).
        tie = sum((_floating_sum(self.block.get_submodule(name)(*_inputs(flat, inputs[0]), **_inputs(flat, inputs[1])))
                   for name, inputs in children), flat.new_zeros(()))
        called = {name for name, _ in children}
        owner = next((name for name, sub in self.block.named_children()
                      if any(p is self.router for p in sub.parameters())), None)
        if owner not in called:  # a router that no recorded child applies: its matmul, as the block does
            router = self.router
            tie = tie + (flat @ (router.t() if router.shape[1] == flat.shape[-1] else router)).sum()
        per_expert = max(1, -(-pairs // self.listed.num_experts))
        tokens = flat[:1].expand(per_expert, width) if width == flat.shape[-1] else flat.new_zeros(per_expert, width)
        for index, expert in enumerate(self.experts):
            with self.traffic.counting(f"{self.listed.fqn}.{index}"):
                tie = tie + expert(tokens).sum()
        # Shapes of the real output; the gradient reaches the hidden states, the router, the children, every expert.
        return tree_map(lambda s: hidden.new_zeros(s[0], dtype=s[1]) + tie.to(s[1]) * 0 if s[1].is_floating_point
                        else hidden.new_zeros(s[0], dtype=s[1]), shapes, is_leaf=_is_shape)

    def _count(self, args: Any, kwargs: Any) -> tuple[int, int, Any, list[tuple[str, Any]]]:
        """The block's forward on the CPU with random values, its expert calls and its other children's calls
        recorded: (pairs, input width, the output's (shape, dtype) tree, [(child, its (args, kwargs) with each tensor
        as its (shape, dtype))])."""
        from torch.utils._python_dispatch import _disable_current_modes

        calls: list[tuple[int, int]] = []
        experts = self.experts
        saved = dict(experts._modules)

        outputs: dict[tuple[int, torch.dtype], Tensor] = {}
        hidden = next(t for t in _tensors((args, kwargs)) if t.is_floating_point())
        # The output's width and dtype: an expert on 0 rows (on meta, with its hooks: tensor parallelism's).
        outputs[(hidden.shape[-1], hidden.dtype)] = saved["0"](hidden.reshape(-1, hidden.shape[-1])[:0])

        def record(index: int, x: Tensor) -> Tensor:
            calls.append((x.numel() // x.shape[-1], x.shape[-1]))
            out = outputs.get((x.shape[-1], x.dtype))
            if out is None:
                raise TypeError(
                    f"{self.listed.fqn}: the planner runs each expert on the MoE block's hidden states "
                    f"(width {hidden.shape[-1]}, {hidden.dtype}), but the block called expert {index} with "
                    f"{list(x.shape)} {x.dtype}. Plan with expert_parallel_size=1 (pin ep=1)."
                )
            return torch.zeros((*x.shape[:-1], out.shape[-1]), dtype=out.dtype)

        children: list[tuple[str, Any]] = []

        def child_called(name: str) -> Callable[..., None]:
            def hook(_: nn.Module, child_args: tuple[Any, ...], child_kwargs: dict[str, Any]) -> None:
                children.append((name, tree_map(lambda t: _Shape(t) if isinstance(t, Tensor) else t, (child_args, child_kwargs))))

            return hook

        values = {name: _random_like(t) for name, t in self.block.named_parameters() if not name.startswith(f"{self.listed.attribute}.")}
        values.update({name: torch.zeros_like(t, device="cpu") for name, t in self.block.named_buffers()})
        forward = self.block.__dict__.pop("forward")
        # Not part of the step: no FLOPs, operators, memory or parameter use counted (modes and hooks off).
        with _disable_current_modes(), _without_hooks(self.block), torch.no_grad():
            handles = [child.register_forward_pre_hook(child_called(name), with_kwargs=True)
                       for name, child in self.block.named_children() if name != self.listed.attribute]
            try:
                for key in saved:
                    experts._modules[key] = _Recording(int(key), record)
                cpu = tree_map(lambda t: _random_like(t) if isinstance(t, Tensor) else t, (args, kwargs))
                out = torch.func.functional_call(self.block, values, cpu[0], cpu[1], strict=False)
            finally:
                for handle in handles:
                    handle.remove()
                experts._modules.clear()
                experts._modules.update(saved)
                self.block.forward = forward
        shapes = tree_map(lambda t: (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else t, out)
        return sum(n for n, _ in calls), max((w for _, w in calls), default=0), shapes, children


class _Shape:
    """A recorded tensor input of a child call: its shape and dtype."""

    def __init__(self, t: Tensor) -> None:
        self.shape, self.dtype = tuple(t.shape), t.dtype


def _inputs(flat: Tensor, recorded: Any) -> Any:
    """Meta inputs of the recorded shapes: hidden-state rows where the width is the hidden states' (so the gradient
    reaches them, as the block's input does), zeros otherwise."""

    def make(shape: _Shape) -> Tensor:
        if shape.dtype.is_floating_point and shape.shape and shape.shape[-1] == flat.shape[-1]:
            rows = math.prod(shape.shape[:-1])
            return flat[:1].to(shape.dtype).expand(rows, flat.shape[-1]).reshape(shape.shape)
        return flat.new_zeros(shape.shape, dtype=shape.dtype)

    return tree_map(lambda t: make(t) if isinstance(t, _Shape) else t, recorded, is_leaf=lambda t: isinstance(t, _Shape))


def _floating_sum(out: Any) -> Tensor:
    """The sum of a call's floating-point outputs (a scalar that ties them into the block's output)."""
    from torch.distributed.tensor import DTensor

    found = [(t.to_local() if isinstance(t, DTensor) else t).sum() for t in _tensors(out) if t.is_floating_point()]
    return sum(found[1:], found[0]) if found else torch.zeros((), device="meta")


class _Recording(nn.Module):
    def __init__(self, index: int, record: Callable[[int, Tensor], Tensor]) -> None:
        super().__init__()
        self.index, self.record = index, record

    def forward(self, x: Tensor) -> Tensor:
        return self.record(self.index, x)


@contextmanager
def _without_hooks(module: nn.Module) -> Iterator[None]:
    """The forward hooks of ``module`` and its submodules off (the dry run's trackers see the meta call only)."""
    saved = [(sub, sub._forward_pre_hooks, sub._forward_hooks) for sub in module.modules()]
    for sub, _, _ in saved:
        sub._forward_pre_hooks, sub._forward_hooks = type(sub._forward_pre_hooks)(), type(sub._forward_hooks)()
    try:
        yield
    finally:
        for sub, pre, post in saved:
            sub._forward_pre_hooks, sub._forward_hooks = pre, post


def _random_like(t: Tensor) -> Tensor:
    if t.is_floating_point():
        return torch.randn(t.shape, dtype=t.dtype)
    return torch.zeros(t.shape, dtype=t.dtype)


def _is_shape(item: Any) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.dtype)


def _tensors(tree: Any) -> Iterator[Tensor]:
    from torch.utils._pytree import tree_leaves

    return (leaf for leaf in tree_leaves(tree) if isinstance(leaf, Tensor))
