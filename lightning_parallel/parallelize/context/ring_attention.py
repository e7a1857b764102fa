"""Ring attention on ordinary (local) tensors: each rank's queries against every rank's keys and values, with masks.

Each rank holds two of the sequence's ``2·cp`` chunks (by default head-tail: chunks ``r`` and ``2·cp−1−r``). Each rank gathers
every rank's keys and values once (one all-gather, as torch's ring with its all-gather rotation), then runs the
blocks its :class:`~.ring_plan.RingPlan` keeps — one fused kernel call per live block (:mod:`.kernels`), skipped
blocks cost nothing — and merges the blocks' outputs by their log-sum-exps. Backward gathers the keys and values
again, runs each live block's kernel backward against the merged output and log-sum-exp, and hands every rank the
gradients of its keys and values (one all-to-all). The algorithm is torch's
(``torch.distributed.tensor.experimental.context_parallel``: ``_templated_ring_attention`` and its backward);
torch's implementation takes no mask, reaches the kernels through DTensor dispatch and covers the CUDA kernels only,
so the loop lives here, on plain tensors, inside one ``autograd.Function``.

Masks: any boolean or additive mask (or bias) SDPA takes, given as this rank's query rows × the whole sequence's
keys in global order (:mod:`.masks` brings the model's mask to that form). A query row that a block's mask drops
entirely contributes nothing to that block (its log-sum-exp there is ``-inf``); a row that every block drops (a
padding query whose keys are all masked) gets a zero output and no gradient, as ``F.scaled_dot_product_attention``
gives it. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel import collectives
from lightning_parallel.measure.collectives import context_parallel_exchange, record_context_work
from lightning_parallel.parallelize.context.kernels import (
    AttentionKernel,
    additive_bias,
    as_autocast_would,
    kernel_for,
)
from lightning_parallel.parallelize.context.masks import four_dims
from lightning_parallel.parallelize.context.ring_plan import (
    CAUSAL,
    MASKED,
    BlockCall,
    RingPlan,
    plan_for_mask,
    plan_without_mask,
)

#: Dimension of the sequence in attention's ``[batch, heads, sequence, head_dim]`` tensors.
SEQUENCE_DIM = 2


def _gather(tensors: tuple[Tensor, ...], group: dist.ProcessGroup | None, size: int) -> list[tuple[Tensor, ...]]:
    """Every rank's ``tensors`` (one all-gather of them flattened together), by rank."""
    if size == 1:
        return [tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    with context_parallel_exchange():
        gathered = collectives.functional_all_gather(flat, 0, group).view(size, -1)
    result = []
    for row in gathered:
        parts, start = [], 0
        for t in tensors:
            parts.append(row[start:start + t.numel()].view(t.shape))
            start += t.numel()
        result.append(tuple(parts))
    return result


def _return_gradients(grads: list[Tensor], group: dist.ProcessGroup | None, size: int) -> Tensor:
    """Each rank's gradient of this rank's keys and values, summed (one all-to-all of ``grads[j]``, flat per rank)."""
    if size == 1:
        return grads[0]
    with context_parallel_exchange():
        received = collectives.functional_all_to_all_single(torch.cat(grads), None, None, group)
    return received.view(size, -1).sum(0)


def _chunks(tensor: Tensor, chunks: tuple[int, ...], chunk: int) -> Tensor:
    """The source rank's ``chunks`` (its chunk indices, increasing) of ``tensor``: a view where they are adjacent."""
    if chunks[-1] - chunks[0] == len(chunks) - 1:
        return tensor.narrow(SEQUENCE_DIM, chunks[0] * chunk, len(chunks) * chunk)
    return torch.cat([tensor.narrow(SEQUENCE_DIM, d * chunk, chunk) for d in chunks], SEQUENCE_DIM)


def _add_to_chunks(total: Tensor, chunks: tuple[int, ...], chunk: int, grad: Tensor) -> None:
    """Add ``grad`` (the gradient of :func:`_chunks`'s result) into ``total``'s ``chunks``, in place."""
    if chunks[-1] - chunks[0] == len(chunks) - 1:
        total.narrow(SEQUENCE_DIM, chunks[0] * chunk, len(chunks) * chunk).add_(grad)
        return
    for i, d in enumerate(chunks):
        total.narrow(SEQUENCE_DIM, d * chunk, chunk).add_(grad.narrow(SEQUENCE_DIM, i * chunk, chunk))


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Merge one block's output and log-sum-exp into the running ones (views, updated in place). Rows with no kept
    score so far (``-inf``) take weight 0, never ``exp(-inf - -inf)``."""
    merged = torch.logaddexp(lse, block_lse)
    base = merged.masked_fill(merged.isneginf(), 0.0)
    out.copy_(out * (lse - base).exp().unsqueeze(-1) + block_out.to(out.dtype) * (block_lse - base).exp().unsqueeze(-1))
    lse.copy_(merged)


def _grouped(kernel: AttentionKernel, groups: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The kernel's forward and backward for grouped-query attention: keys and values travel round the ring with
    their own (fewer) heads and are repeated to the query heads only for each block's kernel call; the gradients of
    the repeats are summed back per key/value head."""
    if groups == 1:
        return kernel.forward, kernel.backward

    def forward(query: Tensor, key: Tensor, value: Tensor, *args: Any) -> Any:
        return kernel.forward(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), *args)

    def backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, *args: Any) -> Any:
        grad_q, grad_k, grad_v = kernel.backward(grad_out, query, key.repeat_interleave(groups, 1),
                                                 value.repeat_interleave(groups, 1), *args)
        fold = lambda g, like: g.unflatten(1, (like.size(1), groups)).sum(2)  # noqa: E731
        return grad_q, fold(grad_k, key), fold(grad_v, value)

    return forward, backward


class _Block:
    """One kernel call's inputs: the query rows, the source rank's key chunks, the bias and the kernel."""

    def __init__(self, query: Tensor, mask: Tensor | None, plan: RingPlan, source: int, call: BlockCall,
                 softcap: float | None) -> None:
        self.rows, self.causal = call.rows, call.kind == CAUSAL
        self.bias = None
        if call.kind == MASKED:
            if mask is None:
                raise RuntimeError(f"Ring step {source} of rank {plan.rank} needs a mask for a masked block.")
            self.bias = additive_bias(plan.mask_block(mask, source, call), query.dtype)
        self.kernel = kernel_for(query, masked=self.bias is not None, softcap=softcap)
        # Rows whose every score in the block is dropped: the kernels report a log-sum-exp of 0 for them.
        self.dead = None if self.bias is None else self.bias.isneginf().all(-1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, plan: RingPlan,
                scale: float | None, group: dist.ProcessGroup | None, softcap: float | None,
                sinks: Tensor | None) -> Tensor:
        half = query.dtype in (torch.float16, torch.bfloat16)
        accumulate = torch.float32 if half else query.dtype
        groups = query.size(1) // key.size(1)
        batch, heads, length = query.shape[:3]
        # The fused kernels return the output laid out [batch, sequence, heads, head_dim] in memory, so that the usual
        # transpose(1, 2).reshape(...) after attention is a view: kept here.
        out = query.new_zeros(batch, length, heads, value.size(-1), dtype=accumulate).transpose(1, 2)
        lse = query.new_full((batch, heads, length), float("-inf"), dtype=accumulate)
        extras: dict[str, tuple[Any, ...]] = {}
        for source, (key_j, value_j) in enumerate(_gather((key, value), group, plan.size)):
            for call in plan.steps[source]:
                block = _Block(query, mask, plan, source, call, softcap)
                forward, _ = _grouped(block.kernel, groups)
                block_out, block_lse, extra = forward(
                    query[:, :, call.rows], _chunks(key_j, call.chunks, plan.chunk).contiguous(),
                    _chunks(value_j, call.chunks, plan.chunk).contiguous(), block.bias, block.causal, scale)
                extras.setdefault(block.kernel.name, extra)
                if block.dead is not None:
                    block_lse = block_lse.masked_fill(block.dead, float("-inf"))
                    block_out = block_out.masked_fill(block.dead.unsqueeze(-1), 0.0)
                _merge(out[:, :, call.rows], lse[:, :, call.rows], block_out, block_lse)
        if sinks is not None:
            # Attention sinks (gpt-oss): one more logit per head, in the softmax's denominator, without a value.
            _merge(out, lse, torch.zeros_like(out), sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse))
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse, mask, sinks)
        ctx.plan, ctx.scale, ctx.group, ctx.extras, ctx.groups = plan, scale, group, extras, groups
        ctx.softcap = softcap
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, out, lse, mask, sinks = ctx.saved_tensors
        plan: RingPlan = ctx.plan
        half = query.dtype in (torch.float16, torch.bfloat16)
        accumulate = torch.float32 if half else query.dtype
        grad_out = grad_out.contiguous()
        # Rows no score reaches: +inf makes every block's share exp(s - lse) zero (no gradient, as SDPA gives).
        grad_sinks = None
        if sinks is not None:
            # d out / d sink = -p_sink · out per row: the sink's share of each row times dO·O, summed.
            share = (sinks.to(lse.dtype).view(1, -1, 1) - lse).exp()
            rows = (grad_out.to(accumulate) * out.to(accumulate)).sum(-1)
            grad_sinks = -(share * rows).sum((0, 2)).to(sinks.dtype)
        lse = lse.masked_fill(lse.isneginf(), float("inf"))
        grad_query = torch.zeros_like(query, dtype=accumulate)
        grad_kv = []
        for source, (key_j, value_j) in enumerate(_gather((key, value), ctx.group, plan.size)):
            grad_key = torch.zeros_like(key_j, dtype=accumulate)
            grad_value = torch.zeros_like(value_j, dtype=accumulate)
            for call in plan.steps[source]:
                block = _Block(query, mask, plan, source, call, ctx.softcap)
                _, backward = _grouped(block.kernel, ctx.groups)
                rows = call.rows
                grads = backward(
                    grad_out[:, :, rows].contiguous(), query[:, :, rows].contiguous(),
                    _chunks(key_j, call.chunks, plan.chunk).contiguous(),
                    _chunks(value_j, call.chunks, plan.chunk).contiguous(),
                    out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), block.bias, block.causal, ctx.scale,
                    ctx.extras[block.kernel.name])
                grad_query[:, :, rows] += grads[0]
                _add_to_chunks(grad_key, call.chunks, plan.chunk, grads[1])
                _add_to_chunks(grad_value, call.chunks, plan.chunk, grads[2])
            grad_kv.append(torch.cat([grad_key.reshape(-1), grad_value.reshape(-1)]))
        own = _return_gradients(grad_kv, ctx.group, plan.size)
        grad_key, grad_value = own[:key.numel()].view(key.shape), own[key.numel():].view(value.shape)
        return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
                None, None, None, None, None, grad_sinks)


def ring_attention(
    query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup | None, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False, attn_mask: Tensor | None = None,
    plan: RingPlan | None = None, rank: int | None = None, size: int | None = None, softcap: float | None = None,
    sinks: Tensor | None = None, assignment: tuple[tuple[int, int], ...] | None = None,
) -> Tensor:
    """``F.scaled_dot_product_attention`` over a sequence split in chunks across ``group``'s ranks.

    Args:
        query, key, value: This rank's ``[batch, heads, local sequence, head_dim]`` slices (``value``'s head
            width may differ from ``query``'s and ``key``'s, as in multi-head latent attention; one key/value
            head broadcasts over the query heads).
        group: The context-parallel ranks, in the order of the chunks' layout.
        is_causal: Causal attention over the global positions (not with ``attn_mask``).
        scale: Softmax scale (``None``: ``1/sqrt(head_dim)``).
        enable_gqa: Fewer key/value heads than query heads (each shared by a group of query heads).
        attn_mask: Boolean (``True`` keeps a score) or additive, broadcastable to ``[batch, heads, local sequence,
            whole sequence]``: this rank's query rows in local order × every key in global order. No gradient.
        plan: The blocks to compute (default: from ``attn_mask``, one host read, or from ``is_causal``).
        rank, size: This rank's index in the ring and the ring's size (default: ``group``'s).
        assignment: Each rank's two chunks of the ``2·size`` (default head-tail; a given ``plan`` carries its own).
        softcap: Scores capped as ``softcap·tanh(s/softcap)`` before the mask (Gemma 2; written-out kernel).
        sinks: One logit per query head added to each softmax's denominator, without a value (gpt-oss's attention
            sinks; differentiable).

    Returns:
        This rank's slice of the attention output (``query``'s shape, ``value``'s head dim).
    """
    from torch.distributed.tensor import DTensor

    if any(isinstance(t, DTensor) for t in (query, key, value)):
        if softcap is not None or sinks is not None:
            raise NotImplementedError("Ring attention over DTensor heads takes no softcap or sinks yet.")
        return _ring_over_local_heads(query, key, value, group, is_causal, scale, enable_gqa, attn_mask, plan, rank,
                                      size, assignment)
    if key.size(1) != query.size(1):
        # Grouped-query attention: the ring passes the keys/values with their own heads (see _grouped).
        # One key/value head broadcasts over the query heads (multi-query attention without enable_gqa, as
        # Falcon calls it): the same math as grouped-query attention with one group.
        if not enable_gqa and not (key.size(1) == 1 and value.size(1) == 1):
            raise ValueError(
                f"scaled_dot_product_attention got {query.size(1)} query heads and {key.size(1)} key/value heads "
                "without enable_gqa=True."
            )
        if query.size(1) % key.size(1) != 0:
            raise ValueError(f"{query.size(1)} query heads are not a multiple of {key.size(1)} key/value heads.")
    if attn_mask is not None and is_causal:
        raise ValueError("scaled_dot_product_attention got both an attn_mask and is_causal=True.")
    if attn_mask is not None and attn_mask.requires_grad:
        raise TypeError(
            "scaled_dot_product_attention got an attention bias that requires gradients (a learned relative-position "
            "bias) under context parallelism: ring attention takes masks and biases without gradients. Set "
            "context_parallel_size=1 for this model."
        )
    rank = (dist.get_rank(group) if group is not None else 0) if rank is None else rank
    size = (dist.get_world_size(group) if group is not None else 1) if size is None else size
    if plan is None:
        local = query.size(SEQUENCE_DIM)
        plan = (plan_without_mask(rank, size, local, is_causal, assignment) if attn_mask is None
                else plan_for_mask(four_dims(attn_mask), rank, size, local, assignment))
    mask = None if attn_mask is None else four_dims(attn_mask)
    computed, skipped = plan.work
    scores = query.size(0) * query.size(1) * plan.chunk ** 2  # per block: batch rows × heads × chunk²
    record_context_work(computed * scores, skipped * scores)
    query, key, value = as_autocast_would(query, key, value)
    qk_width, v_width = query.size(-1), value.size(-1)
    if v_width == qk_width:
        return _RingAttention.apply(query, key.contiguous(), value.contiguous(), mask, plan, scale, group, softcap,
                                    sinks)
    # The fused kernels need one head width for queries, keys and values (multi-head latent attention has
    # narrower values). Zero columns change nothing: padded values give zero output columns, sliced off;
    # padded queries and keys add zero to every score, with the scale of the true query/key width.
    width = max(qk_width, v_width)
    scale = qk_width ** -0.5 if scale is None else scale
    pad = torch.nn.functional.pad
    query, key = pad(query, (0, width - qk_width)), pad(key, (0, width - qk_width))
    out = _RingAttention.apply(query, key.contiguous(), pad(value, (0, width - v_width)).contiguous(), mask, plan,
                               scale, group, softcap, sinks)
    return out[..., :v_width]


def _ring_over_local_heads(
    query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup | None, is_causal: bool, scale: float | None,
    enable_gqa: bool, attn_mask: Tensor | None, plan: RingPlan | None, rank: int | None, size: int | None,
    assignment: tuple[tuple[int, int], ...] | None = None,
) -> Tensor:
    """The ring on DTensor inputs (attention of a tensor-parallel model traced whole, as pipeline stages are):
    heads split over the tensor-parallel ranks (or replicated) are independent of each other, so each rank runs
    the ring on its local heads and the output keeps the query's placements. A mask must be the same for every head
    (or replicated over the heads' split)."""
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
    if isinstance(attn_mask, DTensor):
        if not all(isinstance(p, Replicate) for p in attn_mask.placements):
            raise TypeError(f"scaled_dot_product_attention's attn_mask is laid out {attn_mask.placements} under "
                            "context parallelism: the ring takes a mask replicated over the tensor-parallel ranks.")
        attn_mask = attn_mask.to_local()
    if attn_mask is not None and four_dims(attn_mask).size(1) != 1 and any(
            isinstance(p, Shard) and p.dim == 1 for p in query.placements):
        raise TypeError("scaled_dot_product_attention got a mask per head while the heads are split over the "
                        "tensor-parallel ranks under context parallelism: use a mask shared by the heads.")
    out = ring_attention(query.to_local(), key.to_local(), value.to_local(), group, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa, attn_mask=attn_mask, plan=plan, rank=rank, size=size,
                         assignment=assignment)
    return DTensor.from_local(out, query.device_mesh, query.placements, run_check=False)


__all__ = ["SEQUENCE_DIM", "ring_attention"]
