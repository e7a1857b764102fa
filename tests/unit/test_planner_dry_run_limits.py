"""The planner's meta dry run on what it used to crash on: norms over a split width, autograd all-reduces, experts
called without routing, learnt attention masks, value-dependent operators (profiled, or a clear ValueError)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.plan.profile import profile_model
from tests.hf_models import VOCAB, ViewAttention, ViewAttentionLM, ViewBlock

BATCH = (torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8)))


class _WholeWidthQNorm(ViewAttention):
    """OLMo2's attention: a norm over all query heads together (the whole projected width), before the head split."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__(dim)
        self.q_norm = nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q_norm(self.wq(x)).view(B, L, self.n_heads, -1).transpose(1, 2)
        k = self.wk(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2).repeat_interleave(2, dim=1)
        v = self.wv(x).view(B, L, self.n_kv_heads, -1).transpose(1, 2).repeat_interleave(2, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, L, -1))


class _QNormLM(ViewAttentionLM):
    def __init__(self) -> None:
        super().__init__()
        for layer in self.layers:
            layer.attention = _WholeWidthQNorm()


def test_a_norm_over_the_split_width_profiles_at_tp2_as_the_strategy_runs_it():
    """The norm is recognised on a CPU stand-in of its meta module, and its statistic's autograd all-reduce runs in
    the dry run (which answers ``is_compiling()`` as a compiler would for the model's own checks)."""
    from lightning_parallel.parallelize.tensor.split_norm import recognise_norm

    rms = recognise_norm(nn.RMSNorm(8, eps=1e-6, device="meta"))
    assert (rms.rms, rms.offset) == (True, 0.0)
    assert recognise_norm(nn.LayerNorm(8, device="meta")).rms is False
    prof = profile_model(_QNormLM, BATCH, (1, 2), dtype=torch.float64)
    assert 2 in prof.steps and not prof.tp_invalid
    assert prof.step(2).tp_collectives > 0


class _AllExperts(nn.Module):
    """Llama 4's experts: every expert computes every token it is given (``experts(hidden_states)``, no routing)."""

    def __init__(self, experts: int = 4, dim: int = 32, inner: int = 16) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, dim, 2 * inner) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(experts, inner, dim) * 0.1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(1, -1, hidden.shape[-1]).expand(self.down_proj.shape[0], -1, -1)
        gate, up = torch.bmm(flat, self.gate_up_proj).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, self.down_proj).sum(0).reshape(hidden.shape)


class _AllExpertsBlock(ViewBlock):
    def __init__(self) -> None:
        super().__init__()
        self.experts = _AllExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.experts(x)


class _AllExpertsLM(ViewAttentionLM):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_AllExpertsBlock() for _ in range(2))


def test_experts_called_without_routing_are_profiled_dense_and_never_divided():
    prof = profile_model(_AllExpertsLM, BATCH, (1,), dtype=torch.float64)
    step = prof.step(1)
    assert prof.experts_divisor == 0 and step.expert_counts == () and not step.expert_parameters
    # Their matmuls are counted as the model computes them: 4 experts x 16 tokens x (32 x 32 + 16 x 32) x 2, per layer.
    per_sample = 2 * 4 * 8 * (32 * 32 + 16 * 32) * 2
    dense = profile_model(ViewAttentionLM, BATCH, (1,), dtype=torch.float64).step(1)
    assert sum(step.forward_flops.values()) - sum(dense.forward_flops.values()) == pytest.approx(per_sample)


def test_a_learnt_attention_mask_runs_the_math_path_on_meta():
    from lightning_parallel.measure.dispatch import _cpu_flash_attention

    q = torch.empty(1, 2, 4, 8, device="meta", dtype=torch.float64)
    mask = torch.empty(1, 1, 4, 4, device="meta", dtype=torch.float64, requires_grad=True)
    assert _cpu_flash_attention(q, q, q, attn_mask=mask) is None


class _Picker(nn.Module):
    def __init__(self, unique: bool) -> None:
        super().__init__()
        self.unique = unique

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unique:
            return x[..., : torch.unique(x.argmax(-1)).numel()].sum() * 0 + x
        return x + x.reshape(-1)[torch.nonzero(x.reshape(-1) > 0).flatten()].sum() * 0


class _PickerLM(ViewAttentionLM):
    def __init__(self, unique: bool) -> None:
        super().__init__()
        self.picker = _Picker(unique)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.picker(self.tok(x)).sum() * 0


def test_value_dependent_operators_are_estimated_or_named():
    """``nonzero`` runs at its largest size; ``unique`` (no meta kernel) is a ValueError naming the module."""
    assert profile_model(lambda: _PickerLM(unique=False), BATCH, (1,)).step(1)
    with pytest.raises(ValueError, match=r"reached picker, whose forward runs an operator that needs tensor values.*"
                                         r"_unique2.*explicit layout"):
        profile_model(lambda: _PickerLM(unique=True), BATCH, (1,))


def test_strategy_auto_says_why_it_cannot_plan_a_model_it_cannot_profile():
    from lightning_parallel.plan.choose import choose_layout
    from lightning_parallel.plan.layouts import Workload
    from tests.harness import local_hardware

    with pytest.raises(ValueError, match=r"The planner cannot profile _PickerLM: .* reached picker"):
        choose_layout(_PickerLM(unique=True), BATCH, Workload(devices_per_node=2, num_nodes=1, global_batch=4), local_hardware())


class _CpuLambdaLM(ViewAttentionLM):
    """DiffLlama's lambdas: parameters made by ``torch.normal(..., size=...)``, which ignores the meta device context."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.normal(0.0, 0.1, size=(4,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * torch.exp(self.scale.sum())


def test_parameters_made_outside_the_meta_context_are_profiled_on_meta():
    with torch.device("meta"):
        assert not _CpuLambdaLM().scale.is_meta  # what the dry run's build gets
    step = profile_model(_CpuLambdaLM, BATCH, (1,), dtype=torch.float64).step(1)
    assert step.parameter_bytes["scale"] == 4 * 8


def test_a_tp_degree_the_model_cannot_use_is_rejected_with_the_dry_runs_reason():
    from lightning_parallel.plan.layouts import Workload
    from lightning_parallel.plan.planner import PlanError, plan
    from tests.harness import local_hardware

    prof = profile_model(ViewAttentionLM, BATCH, (1, 8), dtype=torch.float64)
    assert 8 not in prof.steps and prof.tp_invalid[8]
    with pytest.raises(PlanError, match=r"tp=8 × pp=1: the tensor-parallel plan cannot split the model 8 ways: .+"):
        plan(prof, Workload(devices_per_node=8, num_nodes=1, global_batch=8), local_hardware(), {"tp": 8})
