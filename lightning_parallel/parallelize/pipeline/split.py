"""Where to cut a model into pipeline stages: the trunk, the cost of each layer, a balanced partition.

A model's *trunk* is its longest ``nn.ModuleList``/``nn.Sequential`` of layers (a transformer's blocks).
Stages begin at trunk layers; whatever runs before the first layer (embeddings) joins the first stage,
whatever runs after the last (final norm, head) joins the last. ``balance="params"`` weighs each layer by
its parameters (tied weights count on every stage that uses them, as the split replicates them);
``balance="time"`` by its measured forward+backward time on one micro-batch. The partition minimises the
most expensive stage. No Lightning here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_parallel.parallelize.common.meta_run import without_values
from lightning_parallel.parallelize.common.trunk import find_trunk, parameter_count, trunk_layer_names
from lightning_parallel.parallelize.pipeline.opaque_experts import mark_routed_experts, opaque_routed_experts

Balance = Literal["params", "time"]
BALANCES: tuple[str, ...] = ("params", "time")


@dataclass(frozen=True)
class SplitPlan:
    """Where the stages begin, and what share of the cost each stage carries.

    Attributes:
        split_points: Module names (relative to the pipelined module) at which stages 1.. begin.
        stage_costs: Cost of each stage in the unit of ``balance`` (parameters, or seconds).
        balance: ``"params"``, ``"time"``, or ``"given"`` for user-chosen split points.
    """

    split_points: tuple[str, ...]
    stage_costs: tuple[float, ...] = ()
    balance: str = "given"

    def describe(self, prefix: str = "") -> str:
        """One line per stage: where it begins and its share of the cost."""
        starts = ["(start)", *(prefix + p for p in self.split_points)]
        total = sum(self.stage_costs) or 1.0
        lines = []
        for index, start in enumerate(starts):
            share = f" {100 * self.stage_costs[index] / total:5.1f}% of {self.balance}" if self.stage_costs else ""
            lines.append(f"  stage {index}: from {start}{share}")
        return "\n".join(lines)


def partition(costs: Sequence[float], num_parts: int) -> list[int]:
    """Split ``costs`` into ``num_parts`` contiguous non-empty parts minimising the largest part's sum.

    Returns the start index of each part after the first.
    """
    count = len(costs)
    if not 1 <= num_parts <= count:
        raise ValueError(f"cannot split {count} layers into {num_parts} non-empty stages.")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[k][i]: smallest possible maximum when the first i layers form k parts.
    best = [[inf] * (count + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (count + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, count + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                # Prefer later cuts on ties: earlier stages also hold the embeddings' activations.
                if value <= best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], count
    for k in range(num_parts, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return sorted(starts)


def plan_split(
    module: nn.Module,
    num_stages: int,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    balance: Balance = "params",
) -> SplitPlan:
    """Balanced split points over the trunk of ``module``.

    Raises:
        ValueError: If there are fewer trunk layers than stages.
    """
    trunk_name, trunk = find_trunk(module, call_counts(module, example_args, example_kwargs))
    layers = trunk_layer_names(trunk_name, trunk)
    if num_stages > len(layers):
        raise ValueError(
            f"The pipeline needs {num_stages} stages but {trunk_name or type(module).__name__} has only {len(layers)} "
            f"layers to split between (each stage holds at least one). Lower pipeline_parallel_size × stages_per_rank "
            f"to {len(layers)} or less, or use a deeper model."
        )
    costs = layer_costs(module, list(trunk.children()), example_args, example_kwargs, balance)
    starts = partition(costs, num_stages)
    bounds = [0, *starts, len(costs)]
    stage_costs = tuple(sum(costs[a:b]) for a, b in pairwise(bounds))
    return SplitPlan(tuple(layers[i] for i in starts), stage_costs, balance)


def layer_costs(
    module: nn.Module,
    layers: list[nn.Module],
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any],
    balance: Balance,
) -> list[float]:
    """Cost of each trunk layer, with what runs before the trunk added to the first and after it to the last."""
    profile = _profile(module, layers, example_args, example_kwargs, timed=balance == "time")
    if balance == "time":
        costs = list(profile.layer_seconds)
        costs[0] += profile.before_seconds
        costs[-1] += profile.after_seconds
        return costs
    costs = [float(parameter_count(layer)) for layer in layers]
    costs[0] += profile.before_params
    costs[-1] += profile.after_params
    return costs


def call_counts(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, int]:
    """How many times one forward on the example runs each submodule (``id -> count``), in eval mode, without
    gradients, with the RNG state restored (a meta-built module's routed experts only report their output's shape)."""
    counts: dict[int, int] = {}

    def count(mod: nn.Module, _: Any) -> None:
        counts[id(mod)] = counts.get(id(mod), 0) + 1

    handles = [mod.register_forward_pre_hook(count) for mod in module.modules()]
    was_training = module.training
    on_meta = any(p.is_meta for p in module.parameters())
    if on_meta:
        mark_routed_experts(module)
    cuda_devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    try:
        module.eval()
        with torch.random.fork_rng(devices=cuda_devices), torch.no_grad():
            with opaque_routed_experts(module) if on_meta else nullcontext(), without_values() if on_meta else nullcontext():
                module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        module.train(was_training)
    return counts


@dataclass
class _Profile:
    before_params: float = 0.0
    after_params: float = 0.0
    before_seconds: float = 0.0
    after_seconds: float = 0.0
    layer_seconds: tuple[float, ...] = ()


def _profile(
    module: nn.Module, layers: list[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any], timed: bool, repeats: int = 3
) -> _Profile:
    """Run the module on one micro-batch to see which modules run before/after the trunk, and how long
    each layer's forward and backward take (boundary timestamps, median of ``repeats`` runs).

    Runs in eval mode with the RNG state restored afterwards, so batch-norm statistics, dropout masks and
    gradients are exactly as before.
    """
    layer_ids = {id(layer): index for index, layer in enumerate(layers)}
    inside = {id(m) for layer in layers for m in layer.modules()}
    first_call: dict[int, str] = {}
    phase = ["before"]
    grads_before = {p: p.grad for p in module.parameters()}
    handles = []

    def pre_hook(mod: nn.Module, _: Any) -> None:
        if id(mod) == id(layers[0]):
            phase[0] = "trunk"
        if id(mod) not in inside:
            first_call.setdefault(id(mod), phase[0])

    def post_hook(mod: nn.Module, _: Any, __: Any) -> None:
        if id(mod) == id(layers[-1]):
            phase[0] = "after"

    for mod in module.modules():
        handles.append(mod.register_forward_pre_hook(pre_hook))
        handles.append(mod.register_forward_hook(post_hook))
    was_training = module.training
    runs: list[list[float]] = []
    try:
        module.eval()
        cuda_devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
        # A meta-built module cannot route tokens (which tokens reach an expert is data): its experts only report
        # their output's shape, as in the pipeline's trace.
        on_meta = any(p.is_meta for p in module.parameters())
        if on_meta:
            mark_routed_experts(module)
        with torch.random.fork_rng(devices=cuda_devices):
            with torch.no_grad(), opaque_routed_experts(module) if on_meta else nullcontext(), without_values() if on_meta else nullcontext():
                module(*args, **kwargs)
            if timed:
                runs = [_timed_run(module, layers, layer_ids, args, kwargs) for _ in range(repeats)]
    finally:
        for handle in handles:
            handle.remove()
        module.train(was_training)
        for param, grad in grads_before.items():
            param.grad = grad
    profile = _Profile()
    for mod in module.modules():
        where = first_call.get(id(mod))
        if where in ("before", "after"):
            # Own parameters only, aliases kept: a tied weight counts wherever it is used.
            numel = float(sum(p.numel() for p in mod.parameters(recurse=False)))
            if where == "before":
                profile.before_params += numel
            else:
                profile.after_params += numel
    if runs:
        medians = [sorted(values)[len(values) // 2] for values in zip(*runs)]
        profile.before_seconds, profile.after_seconds = medians[0], medians[1]
        profile.layer_seconds = tuple(medians[2:])
    return profile


def _timed_run(
    module: nn.Module, layers: list[nn.Module], layer_ids: dict[int, int], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[float]:
    """One forward+backward; returns [before, after, layer 0, layer 1, ...] seconds (forward + backward)."""
    count = len(layers)
    fwd_start, fwd_end = [0.0] * count, [0.0] * count
    grad_out, grad_in = [0.0] * count, [0.0] * count
    handles = []

    def stamp(store: list[float], index: int) -> Any:
        def hook(grad: Tensor) -> None:
            store[index] = time.perf_counter()

        return hook

    def pre(mod: nn.Module, inputs: tuple[Any, ...]) -> None:
        index = layer_ids[id(mod)]
        fwd_start[index] = time.perf_counter()
        first = next((t for t in tree_leaves(inputs) if isinstance(t, Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(stamp(grad_in, index))

    def post(mod: nn.Module, _: Any, output: Any) -> None:
        index = layer_ids[id(mod)]
        fwd_end[index] = time.perf_counter()
        first = next((t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(stamp(grad_out, index))

    for layer in layers:
        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_forward_hook(post))
    try:
        start = time.perf_counter()
        loss = _differentiable_sum(module(*args, **kwargs), module)
        forward_end = backward_start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
    finally:
        for handle in handles:
            handle.remove()
    before = (fwd_start[0] - start) + (end - grad_in[0] if grad_in[0] else 0.0)
    after = (forward_end - fwd_end[-1]) + (grad_out[-1] - backward_start if grad_out[-1] else 0.0)
    per_layer = [
        (fwd_end[i] - fwd_start[i]) + (grad_in[i] - grad_out[i] if grad_in[i] and grad_out[i] else 0.0) for i in range(count)
    ]
    return [max(before, 0.0), max(after, 0.0), *(max(t, 0.0) for t in per_layer)]


def _differentiable_sum(output: Any, module: nn.Module) -> Tensor:
    floats = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad]
    if not floats:
        raise ValueError(
            f"{type(module).__name__}'s output has no differentiable floating-point tensor to time a backward pass "
            f"with; use balance='params'."
        )
    return sum(t.sum() for t in floats)
