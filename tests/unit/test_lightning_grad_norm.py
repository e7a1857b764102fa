"""lightning_parallel.grad_norm against Lightning's grad_norm on a plain module, and the redirection of Lightning's own
while an engine is set up (the layouts themselves: tests/distributed/test_lightning_callbacks.py)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from lightning.pytorch.utilities import grads
from torch import nn

import lightning_parallel
from lightning_parallel.strategies import HybridParallelStrategy, grad_norms


def module_with_gradients() -> nn.Module:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    module[2].bias.requires_grad_(False)  # no gradient: no entry, as in Lightning's
    module(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum().backward()
    return module


@pytest.mark.parametrize("norm_type", [1, 2, 2.5, "inf"])
def test_drop_in_equals_lightnings_grad_norm_on_one_device(norm_type):
    module = module_with_gradients()
    expected = lightning_grad_norm(module, norm_type, group_separator=":")
    actual = lightning_parallel.grad_norm(module, norm_type, group_separator=":")
    assert list(actual) == list(expected)
    for name, value in expected.items():
        assert float(actual[name]) == pytest.approx(float(value), rel=1e-12), name


def test_drop_in_refuses_what_lightning_refuses():
    with pytest.raises(ValueError, match="norm_type"):
        lightning_parallel.grad_norm(module_with_gradients(), 0)
    assert lightning_parallel.grad_norm(nn.Linear(2, 2), 2) == {}


class _Engine:
    """What grad_norms reads of an engine: its module, no pipeline stages, no experts divided apart."""

    class _Off:
        staged = False
        list_group = None

    def __init__(self, module: nn.Module) -> None:
        self.lightning_module = module
        self.pipeline_parallel = self.expert_parallel = self._Off()


def test_lightnings_grad_norm_runs_the_drop_in_while_an_engine_is_set_up(monkeypatch):
    module, other = module_with_gradients(), module_with_gradients()
    original = grads.grad_norm.__code__
    calls = []
    real = grad_norms.grad_norm
    monkeypatch.setattr(grad_norms, "grad_norm", lambda *args: calls.append(args[0]) or real(*args))
    engine = _Engine(module)
    grad_norms.attach(engine)
    try:
        assert grads.grad_norm.__code__ is not original
        # The name bound at import (as users import it) is redirected too, for the engine's module and its parts.
        lightning_grad_norm(module, 2)
        lightning_grad_norm(module[0], 2)
        assert calls == [module, module[0]]
        # A module the engine does not train gets Lightning's own computation.
        expected = lightning_grad_norm(other, 2)
        assert calls == [module, module[0]] and "grad_2.0_norm_total" in expected
    finally:
        grad_norms.detach(engine)
    assert grads.grad_norm.__code__ is original


def test_lightnings_error_on_dtensor_gradients_names_the_drop_in():
    error = RuntimeError("The tensor has a non-zero number of elements, but its data is not allocated yet.\nIf you're ...")
    HybridParallelStrategy().on_exception(error)
    assert "lightning_parallel.grad_norm(module, norm_type)" in str(error)
