"""Routed experts as one opaque operator in a pipeline's traced graph, so that Mixture-of-Experts models trace.

A MoE block's experts call is data-dependent: which tokens reach which expert (transformers' ``eager`` and
``grouped_mm`` implementations loop over the experts that were hit; expert parallelism's all-to-all sizes its
exchange by the router's counts). torch.export cannot capture that, so the pipeline frontend refused every such model
at its first batch. The router, the weighting, shared experts and everything around them trace fine, so only the
experts call is hidden: while the pipeline traces, each routed-experts module (transformers' layout,
:func:`~lightning_parallel.parallelize.expert.experts.routed_experts`) is called as the operator
``lightning_parallel::routed_experts(hidden, index, weights, key, names, parameters)`` — its output has the hidden
states' shape, which is all the trace needs. The parameters are inputs of the operator, so the split sees which
stage uses them and binds that stage's tensors (plain, tensor- or expert-parallel, gathered) into the call.

When the stage runs, the operator's autograd kernel calls the *live* module (looked up by ``key``) with those
parameters (``torch.func.functional_call``): its own forward, in the experts implementation the model chose, or
expert parallelism's dispatch when the experts are divided. Autograd records that call as usual, so backward needs
no formula of its own and nothing is recomputed. No Lightning here.
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_parallel.parallelize.expert.experts import RoutedExperts, routed_experts
from lightning_parallel.parallelize.pipeline.opaque_blocks import mark_expert_loops, opaque_expert_loops, restore_forward

#: The attribute holding a routed-experts module's key (copied with the module: a meta skeleton keeps it).
KEY_ATTRIBUTE = "_lightning_parallel_experts_key"

#: The library's operators (also :mod:`~lightning_parallel.parallelize.pipeline.opaque_functions`').
LIBRARY = torch.library.Library("lightning_parallel", "FRAGMENT")
LIBRARY.define(
    "routed_experts(Tensor hidden, Tensor index, Tensor weights, int key, str[] names, Tensor[] parameters) -> Tensor"
)
_LIVE: dict[int, weakref.ReferenceType[nn.Module]] = {}
_KEYS = itertools.count()


def is_fake_tensor(tensor: Tensor) -> bool:
    """Whether ``tensor`` only stands for a shape (meta, or torch.export's fake tensors): a kernel reports shapes then."""
    # torch._subclasses.fake_tensor is private (checked against torch 2.13): torch.export runs the module on fake
    # tensors, and the operator's autograd kernel (reached before any fake kernel) must only report the shape then.
    from torch._subclasses.fake_tensor import is_fake

    return tensor.is_meta or is_fake(tensor)


def _run(hidden: Tensor, index: Tensor, weights: Tensor, key: int, names: list[str], parameters: list[Tensor]) -> Tensor:
    if is_fake_tensor(hidden):
        return torch.empty_like(hidden)
    reference = _LIVE.get(key)
    module = reference() if reference is not None else None
    if module is None:
        raise RuntimeError(
            f"A pipeline stage calls routed experts #{key}, whose module no longer exists: the stages outlived the "
            "model they were traced from. Build the pipeline again for this model."
        )
    mesh = _stage_mesh(hidden, index, weights)
    if mesh is not None and not any(isinstance(p, DTensor) and p.device_mesh == mesh for p in parameters):
        return _whole_on_every_rank(module, mesh, names, parameters, (hidden, index, weights))
    return torch.func.functional_call(module, dict(zip(names, parameters)), (hidden, index, weights))


def _stage_mesh(*values: Tensor) -> Any:
    """The mesh of a tensor-parallel stage's global view the call's inputs are DTensors on; ``None``: plain tensors."""
    return next((v.device_mesh for v in values if isinstance(v, DTensor)), None)


def _whole_on_every_rank(module: nn.Module, mesh: Any, names: list[str], parameters: list[Tensor], inputs: tuple[Tensor, ...]) -> Tensor:
    """Experts no tensor-parallel placement holds (expert parallelism divides them over its own mesh, leaving them
    out of the tp plan) called from a stage running in DTensor's global view over ``mesh``: every tp rank runs them
    on the whole values, as eager tensor parallelism does outside pipelines, and the output re-enters the view
    replicated. The gradients flowing back are the same on every tp rank (each computes the same experts on the same
    tokens), which is what ``Replicate`` says."""
    local = [
        v.redistribute(mesh, [Replicate()] * mesh.ndim).to_local() if isinstance(v, DTensor) else v for v in inputs
    ]
    out = torch.func.functional_call(module, dict(zip(names, parameters)), tuple(local))
    return DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)


# The autograd kernel records the module's own operations (its backward is theirs); the explicit kernel serves
# inference mode, where autograd keys are skipped; the meta kernel gives export the output's shape.
LIBRARY.impl("routed_experts", _run, "Autograd")
LIBRARY.impl("routed_experts", _run, "CompositeExplicitAutograd")
LIBRARY.impl("routed_experts", lambda hidden, *_: torch.empty_like(hidden), "Meta")


def mark_routed_experts(module: nn.Module) -> dict[str, RoutedExperts | str]:
    """Give every routed-experts module under ``module`` a key naming it as the live module its stages call.

    A routed-experts module is one expert parallelism recognises (transformers' 3-D layout, also those it cannot
    divide: a reason instead of a layout), or any module holding parameters whose ``forward`` takes the routed
    experts' call, ``(hidden_states, expert indices, routing weights)``: DBRX keeps its experts' weights in a
    submodule, stacked in 2-D. The operator needs only that call, and takes every parameter below the module as an
    input. The outermost such module is marked (its own submodules run inside its call).
    Call it on the module the stages will train, before copying it (a meta skeleton keeps the keys). MoE blocks
    whose experts are an nn.ModuleList are marked too (:func:`.opaque_blocks.mark_expert_loops`), not returned.
    """
    marked: dict[str, RoutedExperts | str] = {}
    for name, sub in module.named_modules():
        if any(name.startswith(f"{outer}.") for outer in marked):
            continue
        experts = routed_experts(sub)
        if experts is None and takes_routed_call(sub):
            experts = "its forward takes the routed experts' call (hidden states, expert indices, routing weights)"
        if experts is None:
            continue
        key = getattr(sub, KEY_ATTRIBUTE, None)
        reference = _LIVE.get(key) if key is not None else None
        if reference is None or reference() is not sub:  # a copy carries its original's key: give it its own
            key = next(_KEYS)
            setattr(sub, KEY_ATTRIBUTE, key)
        _LIVE[key] = weakref.ref(sub)
        marked[name] = experts
    # MoE blocks looping over nn.ModuleList experts: the whole block is an operator of its own.
    mark_expert_loops(module)
    return marked


#: Words naming a routed-experts call's second argument (which experts: ``top_k_index``, ``router_indices``,
#: ``selected_experts``) and third (their weights: ``top_k_weights``, ``routing_weights``).
_INDEX_WORDS = ("index", "indices", "selected")
_WEIGHT_WORDS = ("weight",)


def takes_routed_call(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters and its ``forward`` takes exactly ``(hidden, expert indices, weights)``."""
    if next(module.parameters(), None) is None:
        return False
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(parameters) != 3 or any(p.kind not in positional for p in parameters):
        return False
    index, weights = parameters[1].name.lower(), parameters[2].name.lower()
    return any(word in index for word in _INDEX_WORDS) and any(word in weights for word in _WEIGHT_WORDS)


@contextmanager
def opaque_routed_experts(module: nn.Module) -> Iterator[None]:
    """While tracing ``module``: its marked routed-experts modules are called as the opaque operator (and its marked
    MoE blocks with nn.ModuleList experts as theirs, :mod:`.opaque_blocks`)."""
    patched = []
    for sub in module.modules():
        key = getattr(sub, KEY_ATTRIBUTE, None)
        if key is not None:
            patched.append((sub, sub.__dict__.get("forward")))
            sub.forward = _OpaqueCall(sub, key)
    try:
        with opaque_expert_loops(module):
            yield
    finally:
        for sub, forward in patched:
            restore_forward(sub, forward)


class _OpaqueCall:
    """``experts(hidden_states, top_k_index, top_k_weights)`` as the operator; any other call traced as it is."""

    def __init__(self, module: nn.Module, key: int) -> None:
        self.module, self.key = module, key
        self.forward = module.__dict__.get("forward") or type(module).forward.__get__(module)
        self.signature = inspect.signature(self.forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return self.forward(*args, **kwargs)
        values = [value for value in bound.arguments.values()]
        if len(values) != 3 or not all(isinstance(v, Tensor) for v in values):
            return self.forward(*args, **kwargs)  # another convention (Llama 4 computes every expert): traced as is
        hidden, index, weights = values
        # Its submodules' parameters too (a per-expert norm of the outputs): each an input, so the split places it on
        # the stage and its gradient reaches the stage's copy.
        names = [name for name, _ in self.module.named_parameters()]
        parameters = [self.module.get_parameter(name) for name in names]
        return torch.ops.lightning_parallel.routed_experts(hidden, index, weights, self.key, names, parameters)
