"""Custom ``torch.autograd.Function`` calls as one opaque operator in a pipeline's traced graph.

torch.export traces *through* an ``autograd.Function``: the graph records the operations of its ``forward``, and the
stage's backward becomes autograd's derivative of those operations, not the Function's own ``backward``. For a
Function whose backward is its forward's derivative that changes nothing; for every other one it silently changes the
training: a straight-through estimator (``round`` forward, identity backward) gets zero gradients, a gradient reversal
layer stops reversing, YOSO's attention (transformers' ``YosoCumulation``) trains with another gradient.

So while the pipeline traces, every Function defined outside torch and outside this library is called as the operator
``lightning_parallel::autograd_function(key, tensors) -> Tensor[]``. Its non-tensor arguments (a config dict, a scale)
are kept under ``key``, the tensor arguments (parameters included, so the split puts them on the stage that uses them)
are the operator's inputs. At trace time the operator's kernel runs the Function's ``forward`` on the fake tensors
for the output shapes; when the stage runs it calls ``Function.apply`` itself with the stage's tensors, so autograd
records the Function's node and backward runs its ``backward``. torch's own Functions (checkpointing, collectives)
and this library's keep being traced as before. No Lightning here.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from lightning_parallel.parallelize.pipeline.opaque_experts import LIBRARY, is_fake_tensor

LIBRARY.define("autograd_function(int key, Tensor[] tensors) -> Tensor[]")

#: The ``apply`` every Function inherits (a classmethod of ``torch.autograd.Function``, checked against torch 2.13).
_APPLY = torch.autograd.Function.__dict__["apply"]
#: Functions traced as they are: torch's own, whose backward is what export records, and this library's, which the
#: stages rewrite themselves.
_TRACED_THROUGH = ("torch.", "lightning_parallel.")


@dataclass
class _Call:
    """One traced call: the Function, its arguments' structure with the non-tensor values, where tensors go."""

    function: type[torch.autograd.Function]
    spec: TreeSpec
    leaves: list[Any]
    tensor_slots: list[int]
    outputs: dict[str, Any] = field(default_factory=dict)  # filled at trace time: the outputs' structure

    def arguments(self, tensors: list[Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves = list(self.leaves)
        for slot, tensor in zip(self.tensor_slots, tensors):
            leaves[slot] = tensor
        args, kwargs = tree_unflatten(leaves, self.spec)
        return args, kwargs


_CALLS: dict[int, _Call] = {}
_KEYS = itertools.count()
_TENSOR = object()  # where an output tensor goes in the recorded structure
_STATE = threading.local()  # .depth: inside a Function's own forward, nested Functions run as they are


def _apply(function: type[torch.autograd.Function], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        return _APPLY.__func__(function, *args, **kwargs)
    finally:
        _STATE.depth -= 1


def _run(key: int, tensors: list[Tensor]) -> list[Tensor]:
    call = _CALLS.get(key)
    if call is None:
        raise RuntimeError(
            f"A pipeline stage calls traced autograd.Function #{key}, which this process did not trace: build the "
            "pipeline again in this process."
        )
    args, kwargs = call.arguments(tensors)
    if any(is_fake_tensor(t) for t in tensors):  # the trace: only the outputs' shapes and structure matter
        with torch.no_grad():
            output = _apply(call.function, args, kwargs)
        leaves, spec = tree_flatten(output)
        call.outputs = {"spec": spec, "leaves": [_TENSOR if isinstance(v, Tensor) else v for v in leaves]}
        return [v.clone() for v in leaves if isinstance(v, Tensor)]  # an operator's outputs must not alias its inputs
    leaves, _ = tree_flatten(_apply(call.function, args, kwargs))
    return [v for v in leaves if isinstance(v, Tensor)]


# As for routed experts: the autograd kernel lets autograd record the Function's own node; the explicit kernel serves
# inference mode; the meta kernel is the trace's.
LIBRARY.impl("autograd_function", _run, "Autograd")
LIBRARY.impl("autograd_function", _run, "CompositeExplicitAutograd")
LIBRARY.impl("autograd_function", _run, "Meta")


def _opaque_apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
    module = getattr(cls, "__module__", "") or ""
    nested = getattr(_STATE, "depth", 0) > 0
    if nested or module.startswith(_TRACED_THROUGH) or torch._C._are_functorch_transforms_active():
        return _APPLY.__func__(cls, *args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    slots = [i for i, value in enumerate(leaves) if isinstance(value, Tensor)]
    if not slots:
        return _APPLY.__func__(cls, *args, **kwargs)
    key = next(_KEYS)
    call = _Call(cls, spec, [None if i in slots else v for i, v in enumerate(leaves)], slots)
    _CALLS[key] = call
    tensors = torch.ops.lightning_parallel.autograd_function(key, [leaves[i] for i in slots])
    outputs = iter(tensors)
    filled = [next(outputs) if value is _TENSOR else value for value in call.outputs["leaves"]]
    return tree_unflatten(filled, call.outputs["spec"])


@contextmanager
def opaque_autograd_functions() -> Iterator[None]:
    """While tracing: custom autograd Functions are called as the opaque operator (their backward kept)."""
    torch.autograd.Function.apply = classmethod(_opaque_apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = _APPLY
