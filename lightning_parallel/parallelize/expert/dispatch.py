"""Dropless token dispatch and combine for experts divided over the ranks of an expert-parallel group.

Each rank routes its own tokens (the router runs where the tokens are), then every (token, choice) pair goes to
the rank holding its expert: one all-to-all of the counts, one of the hidden states (and one, without gradient,
of the expert indices local to the receiving rank). The receiving rank runs its experts' own forward on what it
got, each pair once with routing weight 1, and a second all-to-all brings the outputs back, where they are
weighted and summed per token. The sum is the unsplit model's: ``Σ_k w_k · expert_k(x)`` is linear in the weights,
and nothing is ever dropped (no capacity factor), so the math does not change — only the order of the additions.

Gradients flow through both all-to-alls (torch's autograd all-to-all sends them back the way the values came),
to the hidden states and through the weighting to the router; the expert weights' gradients gather on the rank
that holds them, summed over every token routed to them from the whole group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel import collectives
from lightning_parallel.measure.collectives import expert_parallel_exchange, record_expert_load


def dispatch_and_combine(
    run_local_experts: Callable[[Tensor, Tensor, Tensor], Tensor],
    hidden: Tensor,
    expert_index: Tensor,
    routing_weights: Tensor,
    num_experts: int,
    group: dist.ProcessGroup,
) -> Tensor:
    """The experts' combined output for this rank's tokens, computed by the ranks that hold the experts.

    Args:
        run_local_experts: ``(tokens [N, H], local expert index [N, 1], weights [N, 1]) -> [N, H]``: this rank's
            experts on the pairs it received (the module's own forward on its local experts).
        hidden: This rank's tokens, ``[T, H]``.
        expert_index: ``[T, k]`` global expert of each token's choices; values outside ``[0, num_experts)`` are
            no expert (transformers' sentinel) and contribute nothing.
        routing_weights: ``[T, k]`` weight of each choice.
        num_experts: Experts of the whole layer (divisible by the group's size).
        group: The expert-parallel group; rank ``r`` holds experts ``r·E/P ... (r+1)·E/P - 1``.

    Returns:
        ``[T, H]``: ``Σ_k routing_weights[t, k] · expert[expert_index[t, k]](hidden[t])``.
    """
    with expert_parallel_exchange():  # the monitor tallies these collectives as expert parallelism's
        size = dist.get_world_size(group)
        local_experts = num_experts // size
        tokens, choices = expert_index.shape
        experts = expert_index.reshape(-1)
        valid = (experts >= 0) & (experts < num_experts)
        record_expert_load(torch.bincount(experts[valid], minlength=num_experts))
        # Pairs in destination order (stable: pairs of one rank keep token order); pairs with no expert go last, unsent.
        destination = torch.where(valid, experts.div(local_experts, rounding_mode="floor"), size)
        order = torch.argsort(destination, stable=True)
        send_counts = torch.bincount(destination, minlength=size + 1)[:size]
        token_of_pair = torch.arange(tokens, device=hidden.device).repeat_interleave(choices)

        # The counts and the pairs' experts are this layer's own exchanges, as its tokens are (one per MoE layer).
        recv_counts = collectives.functional_all_to_all_single(send_counts, None, None, group)
        # all_to_all takes its split sizes as Python lists (NCCL's too): one read of the device per MoE layer call,
        # both directions at once — as in every dropless dispatch (torchtitan's, Megatron's); only a capacity-padded
        # one (fixed splits, dropped or padded tokens) avoids it.
        splits = torch.cat([send_counts, recv_counts]).tolist()
        send_splits, recv_splits = splits[:size], splits[size:]
        sent = order[: sum(send_splits)]

        outgoing = hidden[token_of_pair[sent]].contiguous()
        incoming = all_to_all_with_gradient(outgoing, recv_splits, send_splits, group)
        local_index = collectives.functional_all_to_all_single(
            (experts[sent] % local_experts).contiguous(), recv_splits, send_splits, group
        )

        ones = routing_weights.new_ones((incoming.shape[0], 1))
        computed = run_local_experts(incoming, local_index.unsqueeze(1), ones).contiguous()
        if incoming.requires_grad and not computed.requires_grad:
            # No token reached this rank's experts (their forward returned fresh zeros): keep the output in the graph,
            # or this rank would skip both all-to-alls in backward while its peers wait for it.
            computed = computed + incoming * 0
        returned = all_to_all_with_gradient(computed, send_splits, recv_splits, group)
        per_pair = returned.new_zeros((tokens * choices, returned.shape[-1])).index_copy(0, sent, returned)
        weighted = per_pair.view(tokens, choices, -1) * routing_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(hidden.dtype)


def all_to_all_with_gradient(tensor: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """``all_to_all_single`` whose backward sends the gradients back the way the values came (both directions
    tallied as expert parallelism's by the monitor)."""
    return _AllToAll.apply(tensor, output_splits, input_splits, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _exchange(tensor, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _exchange(grad.contiguous(), ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def _exchange(tensor: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    # Functional collectives are what DTensor uses, and what the monitor counts (measure/collectives.py).
    with expert_parallel_exchange():
        return collectives.functional_all_to_all_single(tensor, output_splits, input_splits, group)
