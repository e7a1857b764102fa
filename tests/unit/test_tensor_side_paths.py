"""Tensor-parallel plan rules for projectors and side paths (two ranks simulated in this process where run):
a two-layer projector ``a→h, h→e`` (tensor.projector)."""

import copy

import torch
from torch import nn

from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig, check_plan


def _split_and_run(module: nn.Module, simulated_ranks, x: torch.Tensor):
    """``module`` split over 2 simulated tp ranks by the auto plan: (output, whole gradient of each parameter)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_parallel.parallelize.tensor.apply import apply_tensor_parallel
    from lightning_parallel.parallelize.tensor.split_region import reduce_split_region_gradients

    resolved = TensorParallelConfig().resolve(module, tp_size=2, warn=lambda _: None)
    check_plan(module, resolved, 2)
    with simulated_ranks():
        apply_tensor_parallel(module, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), resolved)
        out = module(x)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        reduce_split_region_gradients(module)
        whole = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t)._local_tensors[0]  # noqa: E731
        return whole(out).detach(), {n: whole(p.grad) for n, p in module.named_parameters()}, resolved


def _whole_run(module: nn.Module, x: torch.Tensor):
    out = module(x)
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


def _assert_exact(module: nn.Module, simulated_ranks, x: torch.Tensor):
    expected_out, expected_grads = _whole_run(copy.deepcopy(module), x)
    out, grads, resolved = _split_and_run(module, simulated_ranks, x)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-12, msg=name)
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
