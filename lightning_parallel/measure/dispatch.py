"""DTensor's per-operator host cost: how many operators a step dispatches on DTensors, and what one costs here.

Every aten operator called on a DTensor goes through DTensor's dispatcher on the host — sharding propagation,
unwrapping, wrapping the result — before (and besides) the kernel. On a GPU that overlaps the kernels; on a CPU it
is time the step spends, and for the small matmuls of a tensor-parallel rank it can exceed the FLOPs. The planner
counts the operators in its dry run (:class:`DTensorDispatches`) and multiplies by the cost one takes on this
machine (:func:`dtensor_op_seconds`, measured with the hardware figures): a micro-benchmark, not a fit to the
layouts the planner is judged on. No Lightning here.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class DTensorDispatches(TorchDispatchMode):
    """While active, counts the aten operators called with a DTensor argument (:attr:`count`); the operators
    DTensor runs on their local tensors are not counted again."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs or {}))[0]):
            self.count += 1
        return func(*args, **(kwargs or {}))


def dtensor_op_seconds(mesh: Any, repeats: int = 300) -> float:
    """Host seconds one DTensor operator costs beyond the same operator on plain tensors (median of a mix: an
    elementwise product, a sum, and a matmul of a column-split weight, as a tensor-parallel step runs them)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    plain_x, plain_w = torch.randn(8, 16), torch.randn(16, 16)
    x = distribute_tensor(plain_x, mesh, [Replicate()])
    w = distribute_tensor(plain_w, mesh, [Shard(1)])
    local_w = w.to_local()

    def run(a: torch.Tensor, b: torch.Tensor) -> None:
        (a * a).sum()
        a @ b

    timings = []
    for args in ((x, w), (plain_x, local_w)):
        run(*args)  # warm-up (sharding propagation caches)
        start = time.perf_counter()
        for _ in range(repeats):
            run(*args)
        timings.append((time.perf_counter() - start) / (3 * repeats))
    return max(timings[0] - timings[1], 0.0)
