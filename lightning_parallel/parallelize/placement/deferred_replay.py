"""Making a recorded parameter again on the host (:func:`replay`), or knowing it is one value (:func:`constant`).

The nodes come from :class:`~lightning_parallel.parallelize.placement.deferred_record.Recorder`. A replay runs the
same calls in the same order, under the default dtype they ran under; random calls draw from the global
generator's current state (an explicit ``torch.Generator`` from a copy of its recorded state), so the
caller decides where in the random stream a replay happens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_parallel.parallelize.placement.deferred_record import GeneratorState, Node, Unreplayable

#: Calls that leave memory uninitialised: a node rooted there has no value until something writes it.
EMPTY = {"empty", "empty_like", "new_empty", "empty_strided"}
#: In-place calls that write every element whatever was there before.
OVERWRITE = {"fill_", "zero_", "normal_", "uniform_", "copy_", "random_", "bernoulli_", "exponential_",
             "geometric_", "log_normal_", "cauchy_"}
#: Element-wise calls whose result on one value is the result everywhere (used with scalar arguments only).
ELEMENTWISE = {"mul", "add", "sub", "div", "true_divide", "neg", "pow", "sqrt", "rsqrt", "exp", "log", "abs", "clamp",
               "to", "float", "double", "half", "bfloat16", "type", "clone", "contiguous", "detach", "data",
               "requires_grad_", "__mul__", "__rmul__", "__add__", "__radd__", "__sub__", "__rsub__", "__truediv__",
               "__rtruediv__", "__neg__", "__pow__", "mul_", "add_", "sub_", "div_", "clamp_"}
CONSTANT_FACTORIES = {"ones": 1, "zeros": 0, "ones_like": 1, "zeros_like": 0, "new_ones": 1, "new_zeros": 0}


class ReplayError(RuntimeError):
    """A recorded creation that cannot be replayed (the message says why)."""


#: The most recorded calls a replayed creation may take (replay recurses once per call).
MAX_CALLS = 200


def reason_not_replayable(node: Node | Unreplayable) -> str | None:
    """Why ``node`` cannot be replayed, or ``None`` if it can (and has a value: not left ``torch.empty``)."""
    seen: set[int] = set()
    stack: list[Node | Unreplayable] = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, Unreplayable):
            return current.reason
        if id(current) not in seen:
            seen.add(id(current))
            stack.extend(current.inputs())
    if len(seen) > MAX_CALLS:
        return f"it was made by {len(seen)} recorded torch calls (a loop?), more than the {MAX_CALLS} replayed"
    if isinstance(node, Node) and not defined(node):
        return f"it was made by torch.{node.name} and never given values"
    return None


def defined(node: Node | Unreplayable) -> bool:
    """Whether every element has a value (memory from ``torch.empty`` has none until written)."""
    if isinstance(node, Unreplayable):
        return True
    inputs = node.inputs()
    if node.inplace and (node.name in OVERWRITE or _is_init(node)):
        return all(defined(i) for i in inputs[1:])
    if not node.inplace and node.name in EMPTY:
        return False
    return all(defined(i) for i in inputs)


def _is_init(node: Node) -> bool:
    return getattr(node.func, "__module__", None) == "torch.nn.init"


def replay(node: Node | Unreplayable, memo: dict[int, Tensor] | None = None) -> Tensor:
    """Run ``node``'s calls again on the host (random ones draw from the generator's current state).

    Raises:
        ReplayError: The node cannot be replayed, or the replayed call gave another shape or dtype.
    """
    memo = {} if memo is None else memo
    if isinstance(node, Unreplayable):
        raise ReplayError(node.reason)
    if id(node) in memo:
        return memo[id(node)]
    args, kwargs = _materialise((node.args, node.kwargs), memo)
    default = torch.get_default_dtype()
    torch.set_default_dtype(node.default_dtype)  # a factory without dtype= makes what it made at construction
    try:
        value = node.func(*args, **kwargs)
    except Exception as error:
        raise ReplayError(f"replaying {node.name} failed ({error})") from error
    finally:
        torch.set_default_dtype(default)
    if node.inplace:
        value = kwargs["out"] if "out" in kwargs else args[0] if args else kwargs.get("tensor", kwargs.get("input"))
    elif node.index is not None:
        value = value[node.index]
    if tuple(value.shape) != node.shape or value.dtype != node.dtype:
        raise ReplayError(f"replaying {node.name} gave {tuple(value.shape)} {value.dtype}, not {node.shape} {node.dtype}")
    memo[id(node)] = value
    return value


def _materialise(value: Any, memo: dict[int, Tensor]) -> Any:
    if isinstance(value, (Node, Unreplayable)):
        return replay(value, memo)
    if isinstance(value, GeneratorState):
        generator = torch.Generator(value.device)
        generator.set_state(value.state)
        return generator
    if (isinstance(value, torch.device) and value.type == "meta") or (isinstance(value, str) and value == "meta"):
        return torch.device("cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_materialise(v, memo) for v in value)
    if isinstance(value, dict):
        return {k: _materialise(v, memo) for k, v in value.items()}
    return value


def constant(node: Node | Unreplayable) -> Tensor | None:
    """The one value every element of ``node`` has (a 0-dim tensor of its dtype), or ``None`` if not known to be one.

    Computed by the same calls on one element, so it rounds as the whole tensor does.
    """
    if not isinstance(node, Node) or node.random:
        return None
    inputs = node.inputs()
    if node.name in CONSTANT_FACTORIES or node.name in ("full", "full_like", "new_full"):
        if node.name in CONSTANT_FACTORIES:
            fill = CONSTANT_FACTORIES[node.name]
        else:
            fill = node.kwargs.get("fill_value", node.args[1] if len(node.args) > 1 else None)
        return torch.full((), fill, dtype=node.dtype) if isinstance(fill, (int, float, bool)) else None
    extra = node.args[1:] if node.args else ()
    if (node.inplace and node.name in ("fill_", "zero_")) or (_is_init(node) and node.name in ("ones_", "zeros_", "constant_")):
        fill = {"zero_": 0, "zeros_": 0, "ones_": 1}.get(node.name, node.kwargs.get("val", extra[0] if extra else None))
        return torch.full((), fill, dtype=node.dtype) if isinstance(fill, (int, float, bool)) else None
    if node.name not in ELEMENTWISE or len(inputs) != 1 or not node.args or node.args[0] is not inputs[0]:
        return None
    value = constant(inputs[0])
    if value is None:
        return None
    args, kwargs = _materialise((node.args[1:], node.kwargs), {})
    default = torch.get_default_dtype()
    torch.set_default_dtype(node.default_dtype)
    try:
        result = node.func(value.clone(), *args, **kwargs)
    finally:
        torch.set_default_dtype(default)
    return result if isinstance(result, Tensor) and result.dim() == 0 and result.dtype == node.dtype else None
