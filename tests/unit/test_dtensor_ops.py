"""The CPU attention rules of ``parallelize/tensor/dtensor_ops.py``: SDPA on DTensors split over heads or batch, with
every kind of mask transformers and hand-written models pass, equals SDPA on whole tensors (values and
gradients). Two ranks are simulated in this process (torch's ``LocalTensorMode`` over the ``fake`` backend)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import lightning_parallel.parallelize.tensor.dtensor_ops  # noqa: F401  (registers the rules)


@pytest.fixture
def two_simulated_ranks():
    # Private torch modules, checked against torch 2.13: no public API simulates ranks in one process.
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with LocalTensorMode(2):
            yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


MASKS = {
    "none, causal": None,
    "transformers' [B, 1, L, S]": (2, 1, 8, 8),
    "per head [B, H, L, S]": (2, 4, 8, 8),
    "per head, batch-broadcast [1, H, L, S]": (1, 4, 8, 8),
    "[L, S]": (8, 8),
    "[H, L, S]": (4, 8, 8),
}


#: Every mask plainly; scale, a boolean mask and enable_gqa with transformers' mask and a per-head one.
CASES = [(shape, "plain") for shape in MASKS.values()] + [
    (shape, variant) for shape in ((2, 1, 8, 8), (2, 4, 8, 8)) for variant in ("scale", "boolean mask", "enable_gqa")
]


@pytest.mark.parametrize("split", [Shard(1), Shard(0)], ids=["heads", "batch"])
@pytest.mark.parametrize(("mask_shape", "variant"), CASES, ids=[f"{shape}-{variant}" for shape, variant in CASES])
def test_attention_on_split_dtensors_equals_whole_attention(two_simulated_ranks, split, mask_shape, variant):
    mesh = two_simulated_ranks
    torch.manual_seed(0)
    kv_heads = 2 if variant == "enable_gqa" else 4
    q = torch.randn(2, 4, 8, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 8, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = None
    if mask_shape is not None:
        mask = torch.randn(*mask_shape, dtype=torch.float64)
        if variant == "boolean mask":
            mask = mask > 0
            mask[..., 0] = True  # every query sees a key
    options = dict(is_causal=mask is None, scale=0.3 if variant == "scale" else None, enable_gqa=variant == "enable_gqa")
    weights = torch.arange(8.0, dtype=torch.float64)  # an uneven output gradient
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **options)
    (whole * weights).sum().backward()

    dq, dk, dv = (distribute_tensor(t.detach(), mesh, [split]).requires_grad_() for t in (q, k, v))
    dmask = None if mask is None else distribute_tensor(mask, mesh, [Replicate()])
    out = F.scaled_dot_product_attention(dq, dk, dv, attn_mask=dmask, **options)
    (out * distribute_tensor(weights, mesh, [Replicate()])).sum().backward()

    torch.testing.assert_close(out.full_tensor(), whole, rtol=0, atol=1e-12)
    for split_grad, grad in zip((dq.grad, dk.grad, dv.grad), (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(split_grad.full_tensor(), grad, rtol=0, atol=1e-12)


def test_mask_broadcast_over_heads_keeps_the_heads_split(two_simulated_ranks):
    # transformers' SDPA mask is [B, 1, L, S]: splitting over heads needs no communication.
    mesh = two_simulated_ranks
    q, k, v = (distribute_tensor(torch.randn(2, 4, 8, 8, dtype=torch.float64), mesh, [Shard(1)]) for _ in range(3))
    mask = distribute_tensor(torch.zeros(2, 1, 8, 8, dtype=torch.float64), mesh, [Replicate()])
    assert F.scaled_dot_product_attention(q, k, v, attn_mask=mask).placements == (Shard(1),)


def test_a_mask_split_along_the_sequence_is_refused_with_the_reason(two_simulated_ranks):
    mesh = two_simulated_ranks
    q, k, v = (distribute_tensor(torch.randn(2, 4, 8, 8, dtype=torch.float64), mesh, [Shard(1)]) for _ in range(3))
    mask = distribute_tensor(torch.zeros(2, 1, 8, 8, dtype=torch.float64), mesh, [Shard(2)])
    with pytest.raises(RuntimeError, match="no split of the attention over batch or heads matches"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.fixture
def efficient_attention_on_cpu():
    """A CPU stand-in for CUDA's memory-efficient attention kernel (torch has none on CPU), recording the bias
    each rank's kernel receives. Math attention on the local tensors; forward only."""
    seen: list[tuple[int, ...]] = []

    def kernel(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
        seen.append(tuple(attn_bias.shape))
        scores = query @ key.transpose(-2, -1) * (scale or query.shape[-1] ** -0.5) + attn_bias
        lse = scores.logsumexp(-1)
        seed = torch.zeros((), dtype=torch.int64)
        return (scores.softmax(-1) @ value, lse, seed, seed.clone())

    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_efficient_attention", kernel, "CPU")
    try:
        yield seen
    finally:
        library._destroy()


def test_cuda_efficient_attention_gives_every_rank_its_heads_of_a_broadcast_mask(two_simulated_ranks, efficient_attention_on_cpu):
    """Issue 52, finding 4, checked without a GPU. On CUDA a masked SDPA runs the memory-efficient kernel, whose
    DTensor rule in torch splits ``attn_bias`` over heads (dim 1) with q/k/v. An HF mask ``[B, 1, L, S]`` split on
    its size-1 dim would leave rank 1 an empty bias — but torch's composite SDPA (``preprocess_mask`` in
    aten/src/ATen/native/transformers/attention.cpp) pads the bias to 8-aligned strides and expands it to the
    query's ``[B, H, L, S]`` before the kernel; on DTensors those are the global sizes, so the split is a local
    slice of each rank's own heads. Replayed here step by step on the kernel's real DTensor rule."""
    mesh = two_simulated_ranks
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(2, 1, 8, 8, dtype=torch.float64)  # transformers' shape, values differ per batch and position
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    dq, dk, dv = (distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v))
    bias = distribute_tensor(mask, mesh, [Replicate()])
    bias = F.pad(bias, (0, 8 - bias.shape[-1] % 8))[..., : bias.shape[-1]]  # pad_bias: strides aligned to 8
    bias = bias.expand(dq.shape[0], dq.shape[1], dq.shape[2], dk.shape[2])  # preprocess_mask: the query's sizes
    out, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(dq, dk, dv, bias, False)

    assert out.placements == (Shard(1),)
    assert efficient_attention_on_cpu == [(2, 2, 8, 8)] * 2  # each rank: its two heads of every batch's mask
    torch.testing.assert_close(out.full_tensor(), whole, rtol=0, atol=1e-12)
