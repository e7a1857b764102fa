"""Attention sinks are one per head by their name, also where the head count equals the width of a head (where a
parameter of that length could otherwise be a vector over a head's features, as DiffLlama's ``lambda_q1``)."""

import copy

import pytest
import torch
from torch import nn

from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig, apply_tensor_parallel, check_plan
from lightning_parallel.parallelize.tensor.per_head import find_per_head_parameters


class SinkAttention(nn.Module):
    """Attention with one sink logit per head (gpt-oss's, HY-V4's ``sinks``), as many heads as features per head."""

    def __init__(self, dim: int = 16, heads: int = 4, extra: str = "sinks") -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, dtype=torch.float64) for _ in range(4))
        self.register_parameter(extra, nn.Parameter(torch.randn(heads, dtype=torch.float64)))

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (p(x).view(B, L, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        logits = q @ k.transpose(-1, -2) * self.head_dim**-0.5
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, L, 1)
        weights = torch.cat([logits, sinks], dim=-1).softmax(-1)[..., :-1]
        return self.o_proj((weights @ v).transpose(1, 2).reshape(B, L, -1))


def test_sinks_are_one_per_head_when_heads_and_head_width_coincide(simulated_ranks):
    # HY-V4 (tiny config: 4 heads of 4 features) stayed whole: "sinks: its 4 entries may be one per head ... or one
    # per feature of a head (config.head_dim=4, kept whole): the plan cannot tell which".
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    module, x = SinkAttention(), torch.randn(2, 5, 16, dtype=torch.float64)
    whole = copy.deepcopy(module)
    expected = whole(x)
    (expected * torch.linspace(-1, 1, 16, dtype=torch.float64)).sum().backward()
    resolved = TensorParallelConfig().resolve(module, tp_size=2)
    assert resolved.per_head == {"": ("sinks",)}
    check_plan(module, resolved, 2)
    with simulated_ranks():
        apply_tensor_parallel(module, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), resolved)
        out = module(x)
        (out * torch.linspace(-1, 1, 16, dtype=out.dtype)).sum().backward()
        local = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t)._local_tensors[0]  # noqa: E731
        torch.testing.assert_close(local(out), expected.detach(), rtol=0, atol=1e-12)
        for (name, param), (_, reference) in zip(module.named_parameters(), whole.named_parameters()):
            torch.testing.assert_close(local(param.grad), reference.grad, rtol=0, atol=1e-12, msg=name)


def test_other_parameters_of_a_head_width_stay_ambiguous():
    # The same vector under another name may be one per feature of a head: still refused, with the reason.
    with pytest.raises(ValueError, match="one per head .* or one per feature of a head"):
        find_per_head_parameters(SinkAttention(extra="lambda_q1"), "attn")
