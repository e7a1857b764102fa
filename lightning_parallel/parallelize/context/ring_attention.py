"""Ring attention on ordinary (local) tensors: each rank's queries against every rank's keys and values.

torch implements the ring (``torch.distributed.tensor.experimental.context_parallel``) for the CUDA kernels
only, and reaches it through DTensor dispatch of a monkey-patched ``F.scaled_dot_product_attention``. Here
the same ring algorithm (torch's ``_templated_ring_attention`` and its backward, checked against torch 2.13)
runs inside one ``autograd.Function`` over plain tensors, with the kernel of the device: on CPU
``aten._scaled_dot_product_flash_attention_for_cpu`` (which torch's handlers do not cover), on CUDA the
flash kernel for half precision and the memory-efficient one otherwise (the pairs torch's handlers use).

The sequence must be laid out head-tail (rank ``r`` holds chunks ``r`` and ``2·cp−1−r`` of ``2·cp``): the
ring's causal load balancing skips exactly the blocks that layout makes unnecessary. Non-causal attention
does not depend on the order of the keys, so it runs the ring without load balancing. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# Private torch API (checked against torch 2.13): the ring loops and their options. Wrapped here only.
from torch.distributed.tensor.experimental._context_parallel import (
    _attention as _torch_ring,
)

from lightning_parallel.measure.collectives import context_parallel_exchange

aten = torch.ops.aten

#: Dimension of the sequence in attention's ``[batch, heads, sequence, head_dim]`` tensors.
SEQUENCE_DIM = 2

@dataclass(frozen=True)
class AttentionKernel:
    """One fused attention kernel: its forward and backward ops, and how their extra outputs are passed on."""

    name: str
    forward: Callable[..., tuple[Tensor, ...]]
    backward: Callable[..., tuple[Tensor, ...]]
    grad_out_name: str
    forward_kwargs: Callable[[], dict[str, Any]]
    #: The backward's extra arguments, from what the forward returned after ``(out, logsumexp)``.
    backward_kwargs: Callable[[tuple[Any, ...]], dict[str, Any]]


_CPU = AttentionKernel(
    name="flash (CPU)",
    forward=aten._scaled_dot_product_flash_attention_for_cpu.default,
    backward=aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    grad_out_name="grad_out",
    forward_kwargs=lambda: {"dropout_p": 0.0},
    backward_kwargs=lambda rest: {"dropout_p": 0.0},
)
_CUDA_FLASH = AttentionKernel(
    name="flash (CUDA)",
    forward=aten._scaled_dot_product_flash_attention.default,
    backward=aten._scaled_dot_product_flash_attention_backward.default,
    grad_out_name="grad_out",
    forward_kwargs=lambda: {"dropout_p": 0.0, "return_debug_mask": False},
    backward_kwargs=lambda rest: dict(
        zip(("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset"), rest[:6]), dropout_p=0.0
    ),
)
_CUDA_EFFICIENT = AttentionKernel(
    name="memory-efficient (CUDA)",
    forward=aten._scaled_dot_product_efficient_attention.default,
    backward=aten._scaled_dot_product_efficient_attention_backward.default,
    grad_out_name="grad_out_",
    forward_kwargs=lambda: {"attn_bias": None, "compute_log_sumexp": True, "dropout_p": 0.0},
    backward_kwargs=lambda rest: dict(
        philox_seed=rest[0], philox_offset=rest[1], attn_bias=None, dropout_p=0.0, grad_input_mask=(True, True, True, False)
    ),
)


def kernel_for(query: Tensor) -> AttentionKernel:
    """The fused kernel ring attention runs on ``query``'s device and dtype."""
    if query.device.type == "cpu":
        return _CPU
    if query.device.type == "cuda":
        return _CUDA_FLASH if query.dtype in (torch.float16, torch.bfloat16) else _CUDA_EFFICIENT
    raise NotImplementedError(
        f"Context parallelism has no ring-attention kernel for {query.device.type!r} tensors (CPU and CUDA only)."
    )


@contextmanager
def _ring_options(is_causal: bool, dtype: torch.dtype) -> Generator[None, None, None]:
    # torch's ring reads module-level options. Load balancing is for causal attention (non-causal refuses it);
    # partial results are merged in float32 for half precision only, so float64 stays float64.
    options = _torch_ring._cp_options
    saved = (options.enable_load_balance, options.convert_to_f32, options.rotate_method)
    options.enable_load_balance = is_causal
    options.convert_to_f32 = dtype in (torch.float16, torch.bfloat16)
    options.rotate_method = _torch_ring._RotateMethod.ALL_GATHER
    try:
        yield
    finally:
        options.enable_load_balance, options.convert_to_f32, options.rotate_method = saved


def _as_autocast_would(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The attention inputs as ``F.scaled_dot_product_attention`` computes them under autocast.

    SDPA is on autocast's lower-precision list (CPU and CUDA): under ``bf16-mixed`` it casts query, key and value
    to the autocast dtype, so a model may hand it mixed dtypes (Llama's rotary embedding leaves query and key in
    float32 beside a bfloat16 value). The ring calls the fused kernels directly, which autocast does not cover:
    cast here as autocast would (float64 is never cast by autocast, so float64 stays exact).
    """
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors)


def _grouped_ops(kernel: AttentionKernel, groups: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The kernel's forward and backward for grouped-query attention: keys and values travel round the ring with
    their own (fewer) heads and are repeated to the query heads only for each block's kernel call; the
    gradients of the repeats are summed back per key/value head."""
    if groups == 1:
        return kernel.forward, kernel.backward

    def forward(query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> tuple[Tensor, ...]:
        return kernel.forward(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), **kwargs)

    def backward(*, query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> tuple[Tensor, ...]:
        grads = kernel.backward(query=query, key=key.repeat_interleave(groups, 1), value=value.repeat_interleave(groups, 1), **kwargs)
        grad_key, grad_value = (g.unflatten(1, (key.size(1), groups)).sum(2) for g in grads[1:3])
        return (grads[0], grad_key, grad_value, *grads[3:])

    return forward, backward


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, is_causal: bool, scale: float | None,
                group: dist.ProcessGroup) -> Tensor:
        kernel = kernel_for(query)
        groups = query.size(1) // key.size(1)
        forward_op, _ = _grouped_ops(kernel, groups)
        with _ring_options(is_causal, query.dtype), context_parallel_exchange():
            out, logsumexp, *rest = _torch_ring._templated_ring_attention(
                group, SEQUENCE_DIM, forward_op, query, key, value, is_causal=is_causal, scale=scale,
                **kernel.forward_kwargs(),
            )
        # The fused kernels return the output laid out [batch, sequence, heads, head_dim] in memory, so that the usual
        # transpose(1, 2).reshape(...) after attention is a view, and the output projection saves no copy of it.
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.kernel, ctx.groups, ctx.rest = kernel, groups, tuple(rest)
        ctx.is_causal, ctx.scale, ctx.group = is_causal, scale, group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, out, logsumexp = ctx.saved_tensors
        kernel: AttentionKernel = ctx.kernel
        _, backward_op = _grouped_ops(kernel, ctx.groups)
        with _ring_options(ctx.is_causal, query.dtype), context_parallel_exchange():
            grad_query, grad_key, grad_value, *_ = _torch_ring._templated_ring_attention_backward(
                ctx.group, SEQUENCE_DIM, backward_op, grad_out=grad_out.contiguous(),
                grad_out_name=kernel.grad_out_name, query=query, key=key, value=value, out=out, logsumexp=logsumexp,
                is_causal=ctx.is_causal, scale=ctx.scale, **kernel.backward_kwargs(ctx.rest),
            )
        return grad_query, grad_key, grad_value, None, None, None


def ring_attention(
    query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` over a sequence split head-tail across ``group``'s ranks.

    Args:
        query, key, value: This rank's ``[batch, heads, local sequence, head_dim]`` slices (``value``'s head
            width may differ from ``query``'s and ``key``'s, as in multi-head latent attention; one key/value
            head broadcasts over the query heads).
        group: The context-parallel ranks, in the order of the head-tail layout.
        is_causal: Causal attention over the global positions.
        scale: Softmax scale (``None``: ``1/sqrt(head_dim)``).
        enable_gqa: Fewer key/value heads than query heads (each shared by a group of query heads).

    Returns:
        This rank's slice of the attention output (``query``'s shape, ``value``'s head dim).
    """
    from torch.distributed.tensor import DTensor

    if any(isinstance(t, DTensor) for t in (query, key, value)):
        return _ring_over_local_heads(query, key, value, group, is_causal, scale, enable_gqa)
    if key.size(1) != query.size(1):
        # Grouped-query attention: the ring passes the keys/values with their own heads (see _grouped_ops).
        # One key/value head broadcasts over the query heads (multi-query attention without enable_gqa, as
        # Falcon calls it): the same math as grouped-query attention with one group.
        if not enable_gqa and not (key.size(1) == 1 and value.size(1) == 1):
            raise ValueError(
                f"scaled_dot_product_attention got {query.size(1)} query heads and {key.size(1)} key/value heads "
                "without enable_gqa=True."
            )
        if query.size(1) % key.size(1) != 0:
            raise ValueError(f"{query.size(1)} query heads are not a multiple of {key.size(1)} key/value heads.")
    query, key, value = _as_autocast_would(query, key, value)
    qk_width, v_width = query.size(-1), value.size(-1)
    if v_width == qk_width:
        return _RingAttention.apply(query, key.contiguous(), value.contiguous(), is_causal, scale, group)
    # The fused kernels need one head width for queries, keys and values (multi-head latent attention has
    # narrower values). Zero columns change nothing: padded values give zero output columns, sliced off;
    # padded queries and keys add zero to every score, with the scale of the true query/key width.
    width = max(qk_width, v_width)
    scale = qk_width ** -0.5 if scale is None else scale
    pad = torch.nn.functional.pad
    query, key = pad(query, (0, width - qk_width)), pad(key, (0, width - qk_width))
    out = _RingAttention.apply(query, key.contiguous(), pad(value, (0, width - v_width)).contiguous(), is_causal, scale,
                               group)
    return out[..., :v_width]


def _ring_over_local_heads(
    query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup, is_causal: bool, scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """The ring on DTensor inputs (attention of a tensor-parallel model traced whole, as pipeline stages are):
    heads split over the tensor-parallel ranks (or replicated) are independent of each other, so each rank runs
    the ring on its local heads and the output keeps the query's placements."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tensors = (query, key, value)
    if not all(isinstance(t, DTensor) for t in tensors):
        raise TypeError("scaled_dot_product_attention got a mix of DTensors and plain tensors under context parallelism.")
    for name, tensor in zip(("query", "key", "value"), tensors):
        if not all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim in (0, 1)) for p in tensor.placements):
            raise TypeError(
                f"scaled_dot_product_attention's {name} is laid out {tensor.placements} under context parallelism: the "
                "ring needs whole sequences and head widths on each rank (split by batch or heads only)."
            )
    out = ring_attention(query.to_local(), key.to_local(), value.to_local(), group, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)
    return DTensor.from_local(out, query.device_mesh, query.placements, run_check=False)
