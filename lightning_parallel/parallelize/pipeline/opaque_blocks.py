"""Mixture-of-Experts blocks that loop over ``nn.ModuleList`` experts as one opaque operator in a pipeline's trace.

Older transformers checkpoints and hand-written MoEs keep each expert as a module and loop over them in the block's
own forward (``for e in ...: token = where(chosen == e); if token.numel() == 0: continue; out.index_add_(...)``):
Python control flow on tensor values, which torch.export cannot capture. Hiding only the experts (as
:mod:`.opaque_experts` does for transformers' fused experts) is not enough, since the loop itself is data-dependent,
so while the pipeline traces, the whole block (router, loop, weighting) is called as the operator
``lightning_parallel::expert_loop_block(block, call, tensors, names, parameters) -> Tensor[]``: its tensor arguments
and every parameter below the block are the operator's inputs (the split places them on the stage that calls it),
its other arguments are kept under ``call``.

The output's structure and shapes are learnt by a run, not assumed: at trace time the block's own forward runs once
on zeros of the traced inputs' shapes (on the CPU, its parameters zeros of their shapes, each expert replaced by a
stand-in returning zeros of the shape the expert gives on the meta device, the random-number state restored), so a
block returning ``(hidden, router_logits)`` traces as well as one returning ``hidden``. When the stage runs, the
operator's autograd kernel calls the *live* block's forward (looked up by ``block``; its hooks ran outside the
operator) with the stage's parameters: its own forward, or expert parallelism's two-pass forward once its list is divided
(:mod:`~lightning_parallel.parallelize.expert.module_list`); the parameters of experts another rank holds are then
``None`` and left out. Autograd records that call as usual, so backward is the block's own. No Lightning here.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

# torch.nn.utils.stateless._reparametrize_module is private (checked against torch 2.13): torch.func.functional_call
# without the module's __call__ (its hooks ran where the trace recorded them, outside the operator).
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from lightning_parallel.parallelize.common.expert_lists import find_expert_lists

#: The attribute holding a block's key, and the one naming its expert lists (copied with the module: a meta
#: skeleton keeps both).
KEY_ATTRIBUTE = "_lightning_parallel_expert_loop_key"
LISTS_ATTRIBUTE = "_lightning_parallel_expert_lists"

LIBRARY = torch.library.Library("lightning_parallel", "FRAGMENT")
LIBRARY.define(
    "expert_loop_block(int block, int call, Tensor[] tensors, str[] names, Tensor?[] parameters) -> Tensor[]"
)
_LIVE: dict[int, weakref.ReferenceType[nn.Module]] = {}
_BLOCK_KEYS = itertools.count()
_CALL_KEYS = itertools.count()
_TENSOR = object()  # where an output tensor goes in the recorded structure


@dataclass
class _Call:
    """One traced call of a block: its arguments' structure with the non-tensor values, where the tensors go, and
    (filled by the trace) the outputs' structure."""

    module: nn.Module  # the traced instance (the live block or its meta skeleton): only its structure is used
    forward: Any  # its forward as it was before the trace made it the operator
    spec: TreeSpec
    leaves: list[Any]
    tensor_slots: list[int]
    outputs: dict[str, Any] = field(default_factory=dict)

    def arguments(self, tensors: list[Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves = list(self.leaves)
        for slot, tensor in zip(self.tensor_slots, tensors):
            leaves[slot] = tensor
        return tree_unflatten(leaves, self.spec)


_CALLS: dict[int, _Call] = {}


def _is_fake(tensor: Tensor) -> bool:
    # torch._subclasses.fake_tensor is private (checked against torch 2.13): export runs the module on fake tensors.
    from torch._subclasses.fake_tensor import is_fake

    return tensor.is_meta or is_fake(tensor)


def _run(block: int, call_key: int, tensors: list[Tensor], names: list[str], parameters: list[Tensor | None]) -> list[Tensor]:
    call = _CALLS.get(call_key)
    if call is None:
        raise RuntimeError(
            f"A pipeline stage calls MoE block call #{call_key}, which this process did not trace: build the pipeline "
            "again in this process."
        )
    if any(_is_fake(t) for t in (*tensors, *(p for p in parameters if p is not None))):
        return _shapes_by_a_run(call, tensors, names, parameters)
    reference = _LIVE.get(block)
    module = reference() if reference is not None else None
    if module is None:
        raise RuntimeError(
            f"A pipeline stage calls MoE block #{block}, whose module no longer exists: the stages outlived the model "
            "they were traced from. Build the pipeline again for this model."
        )
    mesh = next((t.device_mesh for t in tensors if isinstance(t, DTensor)), None)
    args, kwargs = call.arguments([_whole(t) for t in tensors])
    # Experts another expert-parallel rank holds are None here (and absent from the live block).
    bound = {name: _whole(p) for name, p in zip(names, parameters) if p is not None}
    # Its forward, not its __call__: the trace recorded the block's hooks outside the operator already.
    with _reparametrize_module(module, bound):
        output = module.forward(*args, **kwargs)
    leaves, _ = tree_flatten(output)
    outputs = [v for v in leaves if isinstance(v, Tensor)]
    if mesh is None:
        return outputs
    # A tensor-parallel stage (DTensor's global view): every tp rank ran the whole block on the whole values (its
    # data-dependent loop has no DTensor rule), so its outputs re-enter the view replicated.
    return [DTensor.from_local(v, mesh, [Replicate()] * mesh.ndim, run_check=False) for v in outputs]


def _whole(tensor: Tensor) -> Tensor:
    """A tensor-parallel stage's DTensor (an input or a parameter split by the plan) as its whole value on every
    rank (differentiable: the gradient goes back to the placement); a plain tensor as it is."""
    if not isinstance(tensor, DTensor):
        return tensor
    return tensor.redistribute(tensor.device_mesh, [Replicate()] * tensor.device_mesh.ndim).to_local()


# The autograd kernel records the block's own operations (its backward is theirs); the explicit kernel serves
# inference mode; the meta kernel is the trace's.
LIBRARY.impl("expert_loop_block", _run, "Autograd")
LIBRARY.impl("expert_loop_block", _run, "CompositeExplicitAutograd")
LIBRARY.impl("expert_loop_block", _run, "Meta")


def _shapes_by_a_run(call: _Call, tensors: list[Tensor], names: list[str], parameters: list[Tensor | None]) -> list[Tensor]:
    """The block's outputs for these (fake) inputs: its forward run once on CPU zeros of their shapes."""
    module = call.module
    lists = getattr(module, LISTS_ATTRIBUTE, ())
    in_lists = tuple(f"{attribute}." for attribute in lists)
    # torch.utils._python_dispatch is private (checked against torch 2.13): the run must be real, outside the
    # trace's fake and proxy modes (and records nothing in the graph).
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad(), torch.random.fork_rng(devices=[]), _experts_stood_in(module, lists):
        zeros = [torch.zeros(t.shape, dtype=t.dtype) for t in tensors]
        args, kwargs = call.arguments(zeros)
        values = {
            name: torch.zeros(p.shape, dtype=p.dtype)
            for name, p in zip(names, parameters) if p is not None and not name.startswith(in_lists)
        }
        values.update({
            name: torch.zeros(b.shape, dtype=b.dtype)
            for name, b in module.named_buffers() if not name.startswith(in_lists)
        })
        # The block's own forward (not the operator it is while traced), without its hooks (a stage's cut is one).
        with _reparametrize_module(module, values):
            output = call.forward(*args, **kwargs)
    leaves, spec = tree_flatten(output)
    call.outputs = {"spec": spec, "leaves": [_TENSOR if isinstance(v, Tensor) else v for v in leaves]}
    anchor = tensors[0]
    return [anchor.new_empty(v.shape, dtype=v.dtype) for v in leaves if isinstance(v, Tensor)]


@contextmanager
def _experts_stood_in(block: nn.Module, lists: tuple[str, ...]) -> Iterator[None]:
    """Each expert of ``block``'s lists answers with zeros of its output's shape (found on the meta device)."""
    saved = []
    for attribute in lists:
        listed = getattr(block, attribute)
        saved.append((listed, dict(listed._modules)))
        for key, expert in listed._modules.items():
            listed._modules[key] = _StandIn(expert)
    try:
        yield
    finally:
        for listed, modules in saved:
            listed._modules.clear()
            listed._modules.update(modules)


class _StandIn(nn.Module):
    """An expert during the shape run: its output's shape from the meta device, as CPU zeros."""

    def __init__(self, expert: nn.Module) -> None:
        super().__init__()
        self.expert = [expert]  # not a submodule: its parameters are not the block's during the run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        expert = self.expert[0]
        meta = {name: torch.empty_like(t, device="meta") for name, t in (*expert.named_parameters(), *expert.named_buffers())}
        on_meta = tree_map(lambda v: v.to("meta") if isinstance(v, Tensor) else v, (args, kwargs))
        output = torch.func.functional_call(expert, meta, *on_meta)
        return tree_map(lambda v: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, Tensor) else v, output)


def mark_expert_loops(module: nn.Module) -> list[str]:
    """Give every MoE block under ``module`` whose experts are an ``nn.ModuleList``
    (:func:`~lightning_parallel.parallelize.expert.module_list.find_expert_lists`) a key naming it as the live block
    its stages call. Call it on the module the stages will train, before copying it. Returns the blocks' FQNs."""
    blocks: dict[str, list[str]] = {}
    for listed in find_expert_lists(module).values():
        blocks.setdefault(listed.block, []).append(listed.attribute)
    for fqn, attributes in blocks.items():
        block = module.get_submodule(fqn)
        key = getattr(block, KEY_ATTRIBUTE, None)
        reference = _LIVE.get(key) if key is not None else None
        if reference is None or reference() is not block:  # a copy carries its original's key: give it its own
            key = next(_BLOCK_KEYS)
            setattr(block, KEY_ATTRIBUTE, key)
        setattr(block, LISTS_ATTRIBUTE, tuple(attributes))
        _LIVE[key] = weakref.ref(block)
    return list(blocks)


@contextmanager
def opaque_expert_loops(module: nn.Module) -> Iterator[None]:
    """While tracing ``module``: its marked MoE blocks are called as the opaque operator."""
    with ExitStack() as stack:
        for sub in module.modules():
            key = getattr(sub, KEY_ATTRIBUTE, None)
            if key is not None:
                forward = sub.__dict__.get("forward")
                sub.forward = _OpaqueBlock(sub, key)
                stack.callback(restore_forward, sub, forward)
        yield


def restore_forward(sub: nn.Module, forward: Any) -> None:
    """Put back the instance ``forward`` a module had before it was patched (``None``: it had none, its class's runs)."""
    if forward is None:
        sub.__dict__.pop("forward", None)
    else:
        sub.forward = forward


class _OpaqueBlock:
    """The block's call as the operator (every parameter below it an input)."""

    def __init__(self, module: nn.Module, key: int) -> None:
        self.module, self.key = module, key
        self.forward = module.__dict__.get("forward") or type(module).forward.__get__(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        slots = [i for i, value in enumerate(leaves) if isinstance(value, Tensor)]
        call_key = next(_CALL_KEYS)
        call = _Call(self.module, self.forward, spec, [None if i in slots else v for i, v in enumerate(leaves)], slots)
        _CALLS[call_key] = call
        names = [name for name, _ in self.module.named_parameters()]
        parameters = [self.module.get_parameter(name) for name in names]
        tensors = torch.ops.lightning_parallel.expert_loop_block(self.key, call_key, [leaves[i] for i in slots], names, parameters)
        outputs = iter(tensors)
        filled = [next(outputs) if value is _TENSOR else value for value in call.outputs["leaves"]]
        return tree_unflatten(filled, call.outputs["spec"])
