"""Sequence parallelism around what the plan keeps whole, in one process (two ranks simulated with torch's
``LocalTensorMode`` over the ``fake`` backend): outputs and every gradient must equal the whole model's."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HEADS, HEAD_DIM, LENGTH = 16, 4, 4, 6


class MultiQueryAttention(nn.Module):
    """Falcon's and GPT-BigCode's multi-query attention, reduced: 4 query heads share one key/value head (it cannot be
    split), a norm over each query head, and a table of positions as long as the sequence (as rotary tables are)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = HEADS, 1, HEAD_DIM
        self.q_proj = nn.Linear(WIDTH, HEADS * HEAD_DIM, dtype=torch.float64)
        self.k_proj = nn.Linear(WIDTH, HEAD_DIM, dtype=torch.float64)
        self.v_proj = nn.Linear(WIDTH, HEAD_DIM, dtype=torch.float64)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, WIDTH, dtype=torch.float64)
        self.q_norm = nn.RMSNorm(HEAD_DIM, dtype=torch.float64)
        self.register_buffer("positions", torch.linspace(0.5, 1.5, LENGTH, dtype=torch.float64).view(1, 1, LENGTH, 1))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        B, L, _ = hidden_states.shape
        q = self.q_norm(self.q_proj(hidden_states).view(B, L, HEADS, HEAD_DIM)).transpose(1, 2) * self.positions
        k = self.k_proj(hidden_states).view(B, 1, L, HEAD_DIM) * self.positions
        v = self.v_proj(hidden_states).view(B, 1, L, HEAD_DIM)
        out = F.scaled_dot_product_attention(q, k.expand(-1, HEADS, -1, -1), v.expand(-1, HEADS, -1, -1), is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1)), None  # (output, attention weights), as HF returns


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(WIDTH, 4 * WIDTH, dtype=torch.float64)
        self.down_proj = nn.Linear(4 * WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    """Falcon's parallel attention and MLP reading one norm, plus Doge's per-feature residual scale held by the block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH, dtype=torch.float64)
        self.attention, self.mlp = MultiQueryAttention(), MLP()
        self.residual_scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.norm(x)
        attended, _ = self.attention(normed)
        return self.residual_scale * x + attended + self.mlp(normed)


class Trunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def weighted_sum(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum()


def test_a_module_kept_whole_runs_on_the_whole_sequence(simulated_ranks):
    # Falcon under tp2 with sequence_parallel=True: its multi-query attention, kept whole, was fed this rank's half of
    # the sequence ("The size of tensor a (8) must match the size of tensor b (16)" applying the rotary tables);
    # GPT-BigCode's, without positions there, trained silently wrong (losses 3e-3 off); Doge's residual scales, used on
    # this rank's tokens, got partial gradients nothing summed.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig, apply_tensor_parallel
    from lightning_parallel.parallelize.tensor.sequence import reduce_partial_gradients, whole_in_block
    from lightning_parallel.parallelize.tensor.split_region import reduce_split_region_gradients

    torch.manual_seed(0)
    module, x = Trunk(), torch.randn(2, LENGTH, WIDTH, dtype=torch.float64)
    whole = copy.deepcopy(module)
    expected_out = whole(x)
    weighted_sum(expected_out).backward()
    resolved = TensorParallelConfig(sequence_parallel=True).resolve(module, tp_size=2, warn=lambda _: None)
    assert "num_key_value_heads=1" in resolved.kept_whole["layers.0.attention"]  # one k/v head: kept whole
    assert resolved.styles["layers.0.mlp.up_proj"] == "colwise"
    assert whole_in_block(dict(module.named_modules()), resolved, "layers.0") == ["layers.0.attention"]
    with simulated_ranks():
        apply_tensor_parallel(module, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), resolved, sequence_parallel=True)
        assert not isinstance(module.layers[0].attention.q_norm.weight, DTensor)  # no SequenceParallel norm inside
        out = module(x)
        weighted_sum(out).backward()
        reduce_partial_gradients(module.parameters())
        reduce_split_region_gradients(module)
        rank0 = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t)._local_tensors[0]  # noqa: E731
        out, grads = rank0(out).detach(), {n: rank0(p.grad) for n, p in module.named_parameters()}
    torch.testing.assert_close(out, expected_out.detach(), rtol=0, atol=1e-12)
    expected = dict(whole.named_parameters())
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name].grad, rtol=0, atol=1e-12, msg=name)
