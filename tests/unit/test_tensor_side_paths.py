"""Tensor-parallel plan rules for projectors and side paths (two ranks simulated in this process where run):
a two-layer projector ``a→h, h→e`` (tensor.projector), adapters added to a split projection (tensor.adapters)."""

import copy

import pytest

import torch
from torch import nn

from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig
from tests.unit.tp_simulated import split_and_run, whole_run


def _assert_exact(module: nn.Module, simulated_ranks, x: torch.Tensor):
    from lightning_parallel.parallelize.tensor.fused import original_order

    expected_out, expected_grads = whole_run(copy.deepcopy(module), x)
    out, grads, resolved = split_and_run(module, simulated_ranks, x, reduce_regions=True, warn=lambda _: None)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    for name, grad in grads.items():  # fused rows gathered rank-major: compared in the module's own order
        torch.testing.assert_close(original_order(module, name, grad), expected_grads[name], rtol=0, atol=1e-12, msg=name)
    return resolved


class Projector(nn.Module):
    """MOSS's audio adaptor: a→h, activation, h→e, then a norm of the output width."""

    def __init__(self, a: int = 24, h: int = 8, e: int = 8) -> None:
        super().__init__()
        self.linear_1, self.act, self.linear_2 = nn.Linear(a, h), nn.SiLU(), nn.Linear(h, e)
        self.norm = nn.LayerNorm(e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear_2(self.act(self.linear_1(x))))


class TwoHeads(nn.Module):
    """The same shapes a→a, a→e, but both read the input, and the first is summed over its features: no chain."""

    def __init__(self) -> None:
        super().__init__()
        self.score, self.value = nn.Linear(8, 8), nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(x).sum(-1, keepdim=True) * self.value(x)


def test_a_two_layer_projector_splits_column_then_row_wise_and_trains_exactly(simulated_ranks):
    torch.manual_seed(0)
    model = nn.ModuleDict({"projector": Projector()}).double()
    resolved = _assert_exact(model["projector"], simulated_ranks, torch.randn(2, 3, 24, dtype=torch.float64))
    assert resolved.styles == {"linear_1": "colwise", "linear_2": "rowwise"}


def test_two_projections_of_a_chains_shapes_not_called_as_one_stay_whole():
    resolved = TensorParallelConfig().resolve(nn.ModuleDict({"heads": TwoHeads(), "projector": Projector()}),
                                              tp_size=2, warn=lambda _: None)
    assert "heads.score" not in resolved.styles and "heads.value" not in resolved.styles
    assert resolved.styles["projector.linear_1"] == "colwise"


class Wrapped(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class AdaptedMLP(nn.Module):
    """Zamba2's shared MLP: a fused gate|up projection plus a per-depth adapter of the same input, then down.

    ``direct``: the adapter is a child of its own (called after gate_up_proj returned), not in a list picked by depth.
    """

    def __init__(self, direct: bool = False, d: int = 16, hidden: int = 32, rank: int = 4) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Linear(d, 2 * hidden, bias=False), nn.Linear(hidden, d, bias=False)
        adapter = nn.Sequential(nn.Linear(d, rank, bias=False), nn.Linear(rank, 2 * hidden, bias=False))
        self.direct = direct
        if direct:
            self.adapter = adapter
        else:
            self.adapter_list = nn.ModuleList([nn.Identity(), adapter])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        gate_up = gate_up + (self.adapter(x) if self.direct else self.adapter_list[1](x))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("direct", [False, True])
def test_an_adapter_added_to_a_split_projection_is_split_with_it_and_trains_exactly(simulated_ranks, monkeypatch, direct):
    # Zamba2: its shared MLP stayed whole (tp2 share 0.735), the adapters' whole output meeting gate_up's slice.
    from tests.unit.test_tensor_plan import _reorder_fused_rows_outside_the_simulation

    _reorder_fused_rows_outside_the_simulation(monkeypatch)
    torch.manual_seed(0)
    model = Wrapped(AdaptedMLP(direct)).double()
    resolved = _assert_exact(model, simulated_ranks, torch.randn(2, 3, 16, dtype=torch.float64))
    adapter = "mlp.adapter" if direct else "mlp.adapter_list.1"
    assert resolved.styles[f"{adapter}.1"] == "fused_gate_up" and resolved.styles[f"{adapter}.0"] == "replicate"
    assert resolved.fused[f"{adapter}.1"] == resolved.fused["mlp.gate_up_proj"] == (32, 32)


def test_an_adapter_reading_another_input_keeps_its_region_whole():
    mlp = AdaptedMLP()
    mlp.adapter_list[1][0] = nn.Linear(8, 4, bias=False)  # not the region's input width: not known to be added there
    resolved = TensorParallelConfig().resolve(nn.ModuleDict({"mlp": mlp, "other": Projector()}), tp_size=2, warn=lambda _: None)
    assert "mlp.gate_up_proj" not in resolved.styles
    assert "a projection left replicated below" in resolved.kept_whole["mlp"]
