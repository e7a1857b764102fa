"""Norms over a split projection's whole width: recognised by what they compute, run on a slice with summed statistics."""

import pytest
import torch
from torch import nn

from lightning_parallel.parallelize.tensor.split_norm import NormMath, SplitWidthNorm, norm_like, recognise_norm
from tests.unit.test_tensor_plan import UnitNorm


class HFRMSNorm(nn.Module):  # transformers' LlamaRMSNorm/Olmo2RMSNorm: statistic in float32
    def __init__(self, width: int, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width) if offset else torch.ones(width))
        self.variance_epsilon, self.offset = 1e-6, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1.0 + self.weight) if self.offset else self.weight) * x.to(dtype)


@pytest.mark.parametrize(
    ("norm", "math"),
    [
        (HFRMSNorm(8).double(), NormMath(rms=True, offset=0.0, compute_dtype=torch.float32)),
        (HFRMSNorm(8, offset=True).double(), NormMath(rms=True, offset=1.0, compute_dtype=torch.float32)),
        (nn.LayerNorm(8).double(), NormMath(rms=False, offset=0.0, compute_dtype=torch.float32)),
    ],
)
def test_norms_are_recognised_by_what_they_compute(norm, math):
    found = recognise_norm(norm)
    assert found is not None and (found.rms, found.offset) == (math.rms, math.offset)


def test_other_math_is_not_recognised_and_a_module_with_more_parameters_is_no_norm():
    assert norm_like(UnitNorm(8)) and recognise_norm(UnitNorm(8)) is None
    assert not norm_like(nn.Linear(8, 8)) and recognise_norm(nn.Linear(8, 8)) is None


def test_recognising_leaves_the_global_random_stream_alone():
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    recognise_norm(HFRMSNorm(8))
    assert torch.equal(torch.rand(2), expected)


@pytest.mark.parametrize("norm", [HFRMSNorm(8).double(), nn.LayerNorm(8).double()])
def test_two_slices_with_summed_statistics_give_the_whole_norm(norm):
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8, dtype=torch.float64))
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    halves = x.split(4, dim=-1)
    outs = []
    for rank in range(2):
        wrapped = SplitWidthNorm(norm, group=None, tp_size=2, tp_rank=rank, name="attn.q_norm")
        # Stand-in for the all-reduce: each sum completed by what the other rank contributes to it, in order.
        sums = iter(_other_rank_sums(norm, x, halves[1 - rank]))
        wrapped._summed = lambda partial, sums=sums: partial + next(sums)
        outs.append(wrapped(halves[rank]))
    torch.testing.assert_close(torch.cat(outs, dim=-1), norm(x), rtol=1e-6, atol=1e-6)


def _other_rank_sums(norm: nn.Module, whole: torch.Tensor, other: torch.Tensor) -> list[torch.Tensor]:
    x, other = whole.to(torch.float32), other.to(torch.float32)
    if isinstance(norm, nn.LayerNorm):
        return [other.sum(-1, keepdim=True), (other - x.mean(-1, keepdim=True)).pow(2).sum(-1, keepdim=True)]
    return [other.pow(2).sum(-1, keepdim=True)]
