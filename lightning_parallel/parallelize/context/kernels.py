"""The fused attention kernels ring attention calls for each block of queries and keys.

Each block runs one kernel call that returns its output and the log-sum-exp of its scores per query; the ring merges
the blocks (:mod:`.ring_attention`). On CPU that is ``aten._scaled_dot_product_flash_attention_for_cpu`` (which takes
an additive mask); on CUDA the flash kernel for half precision without a mask, the memory-efficient kernel otherwise
(the only one of the two that takes a bias). A block's mask reaches the kernel as an additive bias of the query's
dtype (0 where a score is kept, ``-inf`` where it is dropped), as ``F.scaled_dot_product_attention`` converts a
boolean mask itself. No Lightning here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

aten = torch.ops.aten


def additive_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean or additive mask as the additive bias the kernels take: kept scores 0 (boolean ``True``), dropped
    ones ``-inf`` (boolean ``False``, or an additive value at or below half the dtype's minimum: the large negative
    number Hugging Face's additive masks use drops a score as exactly as ``-inf`` does)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    bias = mask.to(dtype)
    return bias.masked_fill(mask <= torch.finfo(mask.dtype).min / 2, float("-inf"))


def dropped(mask: Tensor) -> Tensor:
    """Where a boolean or additive mask drops the score (as :func:`additive_bias` reads it)."""
    if mask.dtype == torch.bool:
        return ~mask
    return mask <= torch.finfo(mask.dtype).min / 2


@dataclass(frozen=True)
class AttentionKernel:
    """One fused attention kernel: a block's forward (output and per-query log-sum-exp) and backward."""

    name: str
    takes_bias: bool
    #: The kernel's log-sum-exp is padded along the queries to a multiple of this (the memory-efficient kernel's 32).
    lse_alignment: int = 1

    def forward(self, query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None, is_causal: bool,
                scale: float | None) -> tuple[Tensor, Tensor, tuple[Any, ...]]:
        """``(out, logsumexp [batch, heads, queries], extra outputs the backward needs)``."""
        if self.name == "flash (CPU)":
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(
                query, key, value, dropout_p=0.0, is_causal=is_causal, attn_mask=bias, scale=scale)
            return out, lse, ()
        if self.name == "flash (CUDA)":
            out, lse, *rest = aten._scaled_dot_product_flash_attention.default(
                query, key, value, dropout_p=0.0, is_causal=is_causal, return_debug_mask=False, scale=scale)
            return out, lse, (*rest[0:2], *rest[4:6])  # cumulative lengths (none: dense), philox seed and offset
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention.default(
            query, key, value, _aligned(bias, query, key), compute_log_sumexp=True, dropout_p=0.0,
            is_causal=is_causal, scale=scale)
        return out, lse[..., :query.size(2)], (seed, offset)

    def backward(self, grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                 bias: Tensor | None, is_causal: bool, scale: float | None, extra: tuple[Any, ...]
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of the block's query, key and value, given the *merged* output and log-sum-exp of the queries
        (the ring's backward: each block's share of the softmax is its scores' ``exp(s - lse)``)."""
        if self.name == "flash (CPU)":
            grads = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
                grad_out, query, key, value, out, lse, dropout_p=0.0, is_causal=is_causal, attn_mask=bias, scale=scale)
            return grads[0], grads[1], grads[2]
        if self.name == "flash (CUDA)":
            cum_q, cum_k, seed, offset = extra
            grads = aten._scaled_dot_product_flash_attention_backward.default(
                grad_out, query, key, value, out, lse, cum_q, cum_k, query.size(2), key.size(2), 0.0, is_causal, seed,
                offset, scale=scale)
            return grads[0], grads[1], grads[2]
        seed, offset = extra
        padded = -query.size(2) % self.lse_alignment
        lse = torch.nn.functional.pad(lse, (0, padded)) if padded else lse
        grads = aten._scaled_dot_product_efficient_attention_backward.default(
            grad_out, query, key, value, _aligned(bias, query, key), out, lse, seed, offset, 0.0,
            (True, True, True, False), is_causal, scale=scale)
        return grads[0], grads[1], grads[2]


def _aligned(bias: Tensor | None, query: Tensor, key: Tensor) -> Tensor | None:
    # The memory-efficient kernel reads the bias in rows aligned to 16 elements and takes it at the full
    # [batch, heads, queries, keys] shape: padded and sliced back, then expanded (as F.scaled_dot_product_attention
    # prepares a mask for it).
    if bias is None:
        return None
    keys = bias.size(-1)
    if keys % 16:
        bias = torch.nn.functional.pad(bias, (0, 16 - keys % 16))[..., :keys]
    return bias.expand(query.size(0), query.size(1), query.size(2), key.size(2))


class MathKernel:
    """Attention written out (matmuls and a softmax), for scores the fused kernels cannot transform: Gemma 2's
    soft-capped logits ``c·tanh(s/c)``. Same contract as :class:`AttentionKernel`; the backward recomputes the
    block's scores."""

    name = "math"
    takes_bias = True
    lse_alignment = 1

    def __init__(self, softcap: float | None = None) -> None:
        self.softcap = softcap

    def _scores(self, query: Tensor, key: Tensor, bias: Tensor | None, is_causal: bool, scale: float | None
                ) -> tuple[Tensor, Tensor | None]:
        scale = query.size(-1) ** -0.5 if scale is None else scale
        scores = torch.matmul(query, key.transpose(-2, -1)) * scale
        capped = None
        if self.softcap is not None:
            capped = torch.tanh(scores / self.softcap)
            scores = capped * self.softcap
        if is_causal:
            keep = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if bias is not None:
            scores = scores + bias
        return scores, capped

    def forward(self, query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None, is_causal: bool,
                scale: float | None) -> tuple[Tensor, Tensor, tuple[Any, ...]]:
        scores, _ = self._scores(query, key, bias, is_causal, scale)
        lse = torch.logsumexp(scores, -1)
        weights = (scores - lse.masked_fill(lse.isneginf(), 0.0).unsqueeze(-1)).exp()
        return torch.matmul(weights, value), lse, ()

    def backward(self, grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                 bias: Tensor | None, is_causal: bool, scale: float | None, extra: tuple[Any, ...]
                 ) -> tuple[Tensor, Tensor, Tensor]:
        scale = query.size(-1) ** -0.5 if scale is None else scale
        scores, capped = self._scores(query, key, bias, is_causal, scale)
        weights = (scores - lse.unsqueeze(-1)).exp()  # the merged log-sum-exp: this block's share
        grad_value = torch.matmul(weights.transpose(-2, -1), grad_out)
        grad_weights = torch.matmul(grad_out, value.transpose(-2, -1))
        grad_scores = weights * (grad_weights - (grad_out * out).sum(-1, keepdim=True))
        if capped is not None:
            grad_scores = grad_scores * (1 - capped.square())
        grad_query = torch.matmul(grad_scores, key) * scale
        grad_key = torch.matmul(grad_scores.transpose(-2, -1), query) * scale
        return grad_query, grad_key, grad_value


CPU_FLASH = AttentionKernel("flash (CPU)", takes_bias=True)
CUDA_FLASH = AttentionKernel("flash (CUDA)", takes_bias=False)
CUDA_EFFICIENT = AttentionKernel("memory-efficient (CUDA)", takes_bias=True, lse_alignment=32)


def kernel_for(query: Tensor, masked: bool = False, softcap: float | None = None) -> AttentionKernel | MathKernel:
    """The fused kernel ring attention runs on ``query``'s device and dtype (``masked``: for a block with a bias;
    ``softcap``: scores capped as ``softcap·tanh(s/softcap)``, written out)."""
    if softcap is not None:
        return MathKernel(softcap)
    if query.device.type == "cpu":
        return CPU_FLASH
    if query.device.type == "cuda":
        half = query.dtype in (torch.float16, torch.bfloat16)
        return CUDA_FLASH if half and not masked else CUDA_EFFICIENT
    raise NotImplementedError(
        f"Context parallelism has no ring-attention kernel for {query.device.type!r} tensors (CPU and CUDA only)."
    )


def as_autocast_would(*tensors: Tensor) -> tuple[Tensor, ...]:
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


__all__ = ["AttentionKernel", "CPU_FLASH", "CUDA_EFFICIENT", "CUDA_FLASH", "MathKernel", "additive_bias",
           "as_autocast_would", "dropped", "kernel_for"]
