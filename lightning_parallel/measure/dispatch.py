"""What a step costs besides its matmuls: operators dispatched on the host, and memory moved by the others.

A CPU step is not its FLOPs alone. Every aten operator costs host time before its kernel (dispatch; for a DTensor
also sharding propagation, unwrapping and wrapping the result), and the operators that are not matmuls (norms,
softmax, activations, residual adds, the optimizer) are bound by memory bandwidth, not by the matmul peak. On a GPU
the host work overlaps the kernels; on a CPU it is time the step spends, and for the small matmuls of a
tensor-parallel rank it can exceed the FLOPs.

The planner counts them in its dry run (:class:`StepOperators`: operators, DTensor operators, bytes the
non-matmul operators read and write) and multiplies by what one costs on this machine (:func:`op_seconds`,
:func:`dtensor_op_seconds`, :func:`memory_bytes_per_second`, measured with the hardware figures): micro-benchmarks,
not a fit to the layouts the planner is judged on. No Lightning here.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_flop_count

_aten = torch.ops.aten


# FlopCounterMode counts the CUDA attention kernels but not the CPU's (torch 2.13). Counted as the model's FLOPs
# (full, not causal, attention; backward twice forward, without the kernel's recomputation of the scores), as the
# math path counts them: model FLOPs never include recomputation (MFU), and the attention throughput measured in
# `matmul_efficiency` is per FLOP counted the same way.
if _aten._scaled_dot_product_flash_attention_for_cpu not in flop_registry:

    @register_flop_formula(_aten._scaled_dot_product_flash_attention_for_cpu)
    def _cpu_flash_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    @register_flop_formula(_aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _cpu_flash_backward_flop(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                                 out_shape: Any = None, **kwargs: Any) -> int:
        return 2 * sdpa_flop_count(query_shape, key_shape, value_shape)


class CpuAttentionKernel(TorchFunctionMode):
    """While active, ``scaled_dot_product_attention`` on meta tensors runs the fused kernel a CPU picks for the same
    inputs, not the math decomposition meta falls back to (a softmax over every score, batched matmuls): the dry
    run then counts the operators, bytes and FLOPs a CPU step runs. Inputs a CPU would run by the math path stay."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is nn.functional.scaled_dot_product_attention:
            fused = _cpu_flash_attention(*args, **kwargs)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _cpu_flash_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                         enable_gqa: bool = False) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor
    from torch.nn.attention import SDPBackend

    local = query._local_tensor if isinstance(query, DTensor) else query
    if not local.is_meta or query.dim() != 4:
        return None
    if attn_mask is not None and attn_mask.requires_grad:
        return None  # a learnt mask (its gradient needed): the CPU's fused kernel cannot take it, the math path runs
    # What a CPU picks for these dtypes, head counts and mask: tiny CPU stand-ins (shapes do not decide it).
    def stand_in(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1, t.shape[1], 1, t.shape[-1], dtype=t.dtype, requires_grad=t.requires_grad)

    mask = None if attn_mask is None else torch.zeros(1, 1, dtype=attn_mask.dtype)
    choice = torch._fused_sdp_choice(stand_in(query), stand_in(key), stand_in(value), mask, dropout_p, is_causal, scale=scale,
                                     enable_gqa=enable_gqa)
    if choice != SDPBackend.FLASH_ATTENTION.value:
        return None
    if enable_gqa and key.shape[1] != query.shape[1]:
        repeats = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    return _aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


#: Matmul sizes whose throughput is measured: a matmul runs at the rate measured for the first size at least its
#: smallest dimension (the one that limits its efficiency), the largest past them.
MATMUL_SIZES = (32, 64, 128, 256, 512)


def matmul_kind(func: Any, smallest_dimension: int) -> str:
    """The measured kind an operator with a FLOP formula runs at: ``attention/<head size>`` for fused attention
    kernels (far from the matmul peak on a CPU), else ``matmul/<size>`` by its smallest dimension."""
    size = next((s for s in MATMUL_SIZES if smallest_dimension <= s), MATMUL_SIZES[-1])
    return f"{'attention' if 'attention' in func.overloadpacket.__name__ else 'matmul'}/{size}"


class StepOperators(TorchDispatchMode):
    """While active, counts the aten operators called (:attr:`ops`), those called with a DTensor argument
    (:attr:`dtensor_ops`; the operators DTensor runs on their local tensors are not counted again), the bytes
    the operators without a FLOP formula read and write (:attr:`memory_bytes`, this rank's local tensors; views
    move nothing) by the segment ``segment()`` names when each runs, and the FLOPs of the others by the size they
    run at (:attr:`matmul_flops`, see :func:`matmul_kind`)."""

    def __init__(self, segment: Callable[[], str] = lambda: "") -> None:
        super().__init__()
        self.segment = segment
        self.ops = 0
        self.dtensor_ops = 0
        self.memory_bytes: dict[str, float] = {}
        self.matmul_flops: dict[str, float] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        from torch.distributed.tensor import DTensor

        out = func(*args, **(kwargs or {}))
        self.ops += 1
        tensors = [t for t in tree_flatten((args, kwargs or {}, out))[0] if isinstance(t, torch.Tensor)]
        if any(isinstance(t, DTensor) for t in tensors):
            self.dtensor_ops += 1
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            local_args, local_kwargs, local_out = tree_map_only(DTensor, lambda t: t._local_tensor, (args, kwargs or {}, out))
            flops = formula(*local_args, **local_kwargs, out_val=local_out)
            operands = [t for t in tree_flatten(local_args)[0] if isinstance(t, torch.Tensor) and t.dim() >= 2][:2]
            smallest = min((d for t in operands for d in t.shape[-2:]), default=MATMUL_SIZES[-1])
            kind = matmul_kind(func, smallest)
            self.matmul_flops[kind] = self.matmul_flops.get(kind, 0.0) + flops
        elif not getattr(func, "is_view", False):
            local = (t._local_tensor if isinstance(t, DTensor) else t for t in tensors)
            moved = sum(t.numel() * t.element_size() for t in local)
            segment = self.segment()
            self.memory_bytes[segment] = self.memory_bytes.get(segment, 0.0) + moved
        return out


class TemporaryPeak(TorchDispatchMode):
    """While active, the most bytes held at once by the tensors operators create (:attr:`peak`, this rank's
    local tensors): outputs that are neither views nor one of the operator's own inputs (in place, ``out=``),
    counted until their last reference goes. Run around an optimizer step on meta, it measures the temporaries the
    optimizer's implementation allocates (a square root and a denominator per tensor for AdamW's per-tensor loop;
    whole lists for ``foreach``), which live beside the parameters, gradients and state."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        from lightning_parallel.measure.memory import local_bytes

        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False):
            return out
        inputs = {id(t) for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and id(tensor) not in inputs:
                size = local_bytes(tensor)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._free, size)
        return out


# ---------------------------------------------------------------------------------------------- micro-benchmarks


#: Bytes of distinct operands the micro-benchmarks cycle through: more than a core's private caches hold, as a
#: training step's weights and activations are, so each operator reads its operands from farther away, as in a step.
#: (One operand set reused would stay in cache and run faster than any step does.)
WORKING_SET_BYTES = 64 * 2**20


def _rotating(make: Callable[[], Any], bytes_each: int) -> Callable[[], Any]:
    """A callable returning one of enough ``make()`` operand sets to fill :data:`WORKING_SET_BYTES`, in turn."""
    sets = [make() for _ in range(max(1, WORKING_SET_BYTES // max(bytes_each, 1)))]
    position = [0]

    def next_set() -> Any:
        position[0] = (position[0] + 1) % len(sets)
        return sets[position[0]]

    return next_set


def _best_rate(run: Callable[[], Any], work: float, seconds: float) -> float:
    """The best of three ``work``-per-second rates of ``run``, each over ``seconds / 3``."""
    run()  # warm-up
    best = 0.0
    for _ in range(3):
        repeats, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 3:
            run()
            repeats += 1
        best = max(best, work * repeats / (time.perf_counter() - start))
    return best


def matmul_efficiency(seconds: float = 0.1) -> dict[str, float]:
    """Throughput of each kind :func:`matmul_kind` names, relative to the peak (a ``(16·512 × 512) @ (512 × 512)``
    matmul on operands in cache, as a peak is quoted).

    ``matmul/<s>``: the three products of a ``s × s`` linear layer's training on ``16·s`` rows (forward, input
    gradient, weight gradient: each a different memory layout); ``attention/<s>``: forward and backward of causal
    attention over 64 positions with heads of ``s``, with its FLOPs counted as FlopCounterMode counts them. Both on
    operands cycling through :data:`WORKING_SET_BYTES`, as a step's are."""
    from torch.nn.functional import scaled_dot_product_attention

    a, b = torch.randn(16 * 512, 512), torch.randn(512, 512)
    peak = _best_rate(lambda: a @ b, 2 * 16 * 512**3, seconds)
    rates = {}
    for size in MATMUL_SIZES:
        linear = _rotating(lambda s=size: (torch.randn(16 * s, s), torch.randn(s, s), torch.randn(16 * s, s)), 4 * (32 * size**2 + size**2))

        def linear_step(linear: Callable[[], Any] = linear) -> None:
            x, w, grad = linear()
            x @ w.t()
            grad @ w
            grad.t() @ x

        rates[f"matmul/{size}"] = _best_rate(linear_step, 3 * 2 * 16 * size**3, seconds)
        heads = _rotating(lambda s=size: torch.randn(8, 4, 64, s, requires_grad=True), 4 * 8 * 4 * 64 * size)
        counted = 3 * 4 * 8 * 4 * 64**2 * size  # forward 4·B·H·S²·D, backward twice that
        rates[f"attention/{size}"] = _best_rate(
            lambda heads=heads: (lambda q: scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward())(heads()), counted, seconds
        )
    return {kind: min(1.0, value / peak) for kind, value in rates.items()}


def op_seconds(repeats: int = 40, length: int = 50) -> float:
    """Host seconds of one aten operator of a training step on a tiny tensor (dispatch, not work): forward and
    backward of a chain of small elementwise operators under autograd (recording the graph, running its nodes),
    per operator :class:`StepOperators` counts in it."""
    x = torch.ones(4, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(length):
            y = nn.functional.gelu(y * 1.01 + 0.1)
        y.sum().backward()

    counter = StepOperators()
    with counter:
        chain()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            chain()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best / counter.ops


def memory_step(elements: int = 2**19) -> tuple[Callable[[], None], int]:
    """One round of the non-matmul operators of a training step (a residual add, an activation, a softmax and a layer
    norm on activations of 2 MiB float32, cycling through :data:`WORKING_SET_BYTES`), and the bytes it moves as
    :class:`StepOperators` counts them (inputs and outputs)."""
    operands = _rotating(lambda: (torch.randn(elements // 128, 128), torch.randn(elements // 128, 128)), 8 * elements)
    weight, bias = torch.ones(128), torch.zeros(128)
    step = [
        (lambda x, y: torch.add(x, y), 3),
        (lambda x, y: nn.functional.gelu(x), 2),
        (lambda x, y: torch.softmax(x, dim=-1), 2),
        (lambda x, y: nn.functional.layer_norm(x, (128,), weight, bias), 2),
    ]

    def run() -> None:
        for operator, _ in step:
            operator(*operands())

    return run, sum(tensors * elements * 4 for _, tensors in step)


def memory_bytes_per_second(elements: int = 2**19, repeats: int = 20) -> float:
    """Bytes per second the non-matmul operators of a training step move with this process's threads
    (:func:`memory_step`, the best of three rounds)."""
    run, moved = memory_step(elements)
    run()  # warm-up
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        best = min(best, time.perf_counter() - start)
    return repeats * moved / best


def optimizer_op_seconds(mesh: Any = None, tensors: int = 16, repeats: int = 20) -> float:
    """Host seconds of one operator of an optimizer step (no autograd; tiny tensors, so dispatch, not work): AdamW,
    the common choice, over ``tensors`` parameters of 16 elements, per operator :class:`StepOperators` counts.

    With ``mesh`` (a one-rank mesh: no communication), the parameters are DTensors, as tensor parallelism and
    sharded data parallelism leave them, and each operator pays DTensor's dispatch."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    def parameter() -> nn.Parameter:
        value = torch.randn(16)
        return nn.Parameter(value if mesh is None else distribute_tensor(value, mesh, [Replicate()]))

    parameters = [parameter() for _ in range(tensors)]
    for p in parameters:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(parameters, lr=1e-3)
    optimizer.step()  # state, sharding propagation caches
    counter = StepOperators()
    with counter:
        optimizer.step()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            optimizer.step()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best / max(counter.ops, 1)


def dtensor_op_seconds(mesh: Any, repeats: int = 20) -> float:
    """Host seconds one DTensor operator costs beyond the same work on plain tensors, in forward and backward of a
    column- then row-split MLP (as a tensor-parallel step runs them: autograd, views, redistributions).

    Measure it on a one-rank mesh: its collectives are no-ops, so what remains is DTensor's own host work, and the
    time of collectives is the latency's to model."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def blocks() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(4)])

    plain, split = blocks(), blocks()
    for block in split:
        parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(8, 32)

    def step(model: nn.Module) -> None:
        model(x).sum().backward()

    timings = []
    for model in (split, plain):
        for _ in range(3):
            step(model)  # warm-up (sharding propagation caches)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(repeats):
                step(model)
            best = min(best, (time.perf_counter() - start) / repeats)
        timings.append(best)
    counter = StepOperators()
    with counter:
        step(split)
    return max(timings[0] - timings[1], 0.0) / max(counter.dtensor_ops, 1)
