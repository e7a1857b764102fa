"""fp16 (``precision="16-mixed"``) on 2 simulated ranks: an overflow on one rank's shard is the gradient scaler's to
handle, and every rank agrees on it — all skip the step and lower the scale — in Lightning's order: scale the loss,
backward, the guard (the loss), unscale (the gradients judged and the verdict agreed), clip, step or skip."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_parallel.parallelize.common.grad_norm import clip_grad_norm_
from lightning_parallel.strategies.components import nonfinite
from lightning_parallel.strategies.components.nonfinite import NonFiniteGuard
from lightning_parallel.strategies.precision import WorldGradScaler, agree_found_inf

SCALE = 2.0**16


def engine(plugin) -> SimpleNamespace:
    return SimpleNamespace(root_device=torch.device("cpu"), precision_plugin=plugin,
                           lightning_module=SimpleNamespace(trainer=SimpleNamespace(global_step=5)))


@pytest.fixture
def real_values(monkeypatch):
    """LocalTensorMode computes real values over the fake group, which the guard otherwise takes for a dry run's."""
    monkeypatch.setattr(nonfinite, "is_dry_run", lambda: False)


def one_step(plugin, guard: NonFiniteGuard, loss_of, events: list[str]):
    """One optimizer step as Lightning runs it under the strategy: a tp-split weight (a DTensor gradient) beside a
    whole one (a plain gradient); ``loss_of(split, whole)`` is this step's loss on each simulated rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    split = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    whole = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([split, whole], lr=0.1)
    step = optimizer.step

    def counted_step(*args, **kwargs):
        events.append("step")
        return step(*args, **kwargs)

    optimizer.step = counted_step
    scaler = plugin.scaler
    unscale = scaler.unscale_
    scaler.unscale_ = lambda opt: (events.append("unscale"), unscale(opt))[1]
    check = guard._check
    guard._check = lambda loss, opt: (events.append("guard"), check(loss, opt))[1]
    # Lightning's _after_closure: the on_before_optimizer_step hooks, then clipping by norm.
    plugin._after_closure = lambda model, opt: (events.append("clip"), clip_grad_norm_([split, whole], 1.0))

    def closure():
        loss = loss_of(split, whole)
        events.append("scale")
        scaled = scaler.scale(loss)  # Lightning's MixedPrecision.pre_backward
        events.append("backward")
        scaled.backward()
        return loss

    module = SimpleNamespace(automatic_optimization=True)
    guard.around_optimizer_step(optimizer, closure, run=lambda c: plugin.optimizer_step(optimizer, model=module, closure=c))
    return split, whole


def per_rank(tensor: torch.Tensor) -> list[float]:
    return [float(t) for t in tensor._local_tensors.values()]


def test_an_overflow_on_one_rank_skips_the_step_and_lowers_the_scale_on_every_rank(simulated_ranks, real_values):
    from torch.distributed._local_tensor import LocalTensor

    plugin = MixedPrecision("16-mixed", "cpu")
    guard = NonFiniteGuard(engine(plugin), "error")  # the default mode: an overflow is no error
    guard.apply(trainer=None, fitting=True)
    assert isinstance(plugin.scaler, WorldGradScaler)
    # Rank 1's shard of the input is large enough that its scaled gradient overflows float32; rank 0's is not.
    inputs = LocalTensor({0: torch.ones(2, 2), 1: torch.full((2, 2), 1e36)})
    events: list[str] = []
    with simulated_ranks():
        split, whole = one_step(plugin, guard, lambda s, w: (s.to_local() * inputs).sum() + w.sum(), events)
        assert per_rank(plugin.scaler._scale) == [SCALE / 2, SCALE / 2]  # lowered on every rank
        assert all(torch.equal(t, torch.ones(2, 2)) for t in split.to_local()._local_tensors.values())  # not stepped
    assert events == ["scale", "backward", "guard", "unscale", "clip"]  # and no "step", on any rank
    assert guard.skipped_steps == 0  # the scaler's skip, not the guard's
    torch.testing.assert_close(whole.detach(), torch.ones(3))


def test_torch_scaler_alone_lets_the_ranks_disagree(simulated_ranks):
    """What the strategy replaces: torch's GradScaler finds the inf on rank 1 only (rank 0 would step)."""
    from torch.distributed._local_tensor import LocalTensor

    scaler = torch.amp.GradScaler(device="cpu")
    param = nn.Parameter(torch.ones(2))
    inputs = LocalTensor({0: torch.ones(2), 1: torch.full((2,), 1e36)})
    optimizer = torch.optim.SGD([param], lr=0.1)
    with simulated_ranks():
        scaler.scale((param * inputs).sum()).backward()
        scaler.unscale_(optimizer)
        (found,) = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
        assert per_rank(found) == [0.0, 1.0]


def test_a_non_finite_loss_skipped_under_the_scaler_leaves_the_scale(simulated_ranks, real_values):
    from torch.distributed._local_tensor import LocalTensor

    plugin = MixedPrecision("16-mixed", "cpu")
    guard = NonFiniteGuard(engine(plugin), "skip")
    guard.apply(trainer=None, fitting=True)
    poison = LocalTensor({0: torch.tensor(0.0), 1: torch.tensor(float("nan"))})
    events: list[str] = []
    with simulated_ranks(), pytest.warns(UserWarning, match="skipped optimizer step 5 on every rank: non-finite loss"):
        one_step(plugin, guard, lambda s, w: (s.to_local().sum() + w.sum()) * 0 + poison, events)
        # Neither unscaled (the scaler would fail on an optimizer without gradients) nor updated: no overflow happened.
        assert per_rank(plugin.scaler._scale) == [SCALE, SCALE]
    assert events == ["scale", "backward", "guard", "clip"]
    assert guard.skipped_steps == 1


def test_the_scaler_is_replaced_with_its_settings_and_state():
    scaler = torch.amp.GradScaler(device="cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    agree_found_inf(plugin)
    assert isinstance(plugin.scaler, WorldGradScaler)
    assert plugin.scaler.state_dict() == scaler.state_dict()
    agreed = plugin.scaler
    agree_found_inf(plugin)  # every fit's setup: kept
    assert plugin.scaler is agreed


def test_a_scaler_of_another_class_is_kept_with_a_warning():
    class Custom(torch.amp.GradScaler):
        pass

    plugin = MixedPrecision("16-mixed", "cpu", scaler=Custom(device="cpu"))
    with pytest.warns(UserWarning, match="Custom is kept as given"):
        agree_found_inf(plugin)
    assert type(plugin.scaler) is Custom


def test_bf16_and_full_precision_have_no_scaler_to_replace():
    plugin = MixedPrecision("bf16-mixed", "cpu")
    agree_found_inf(plugin)
    assert plugin.scaler is None


def test_a_pipeline_scales_its_losses_by_the_scaler_as_lightning_scales_the_closure_loss():
    # The schedule runs backward itself: without the scaler's scale on its losses, unscale_ would divide gradients
    # that were never multiplied (65536 times too small).
    from lightning_parallel.strategies.components.pipeline.component import loss_factor

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=SCALE))
    factor = loss_factor(plugin, accumulate_grad_batches=4, device=torch.device("cpu"))
    assert isinstance(factor, torch.Tensor) and float(factor) == SCALE / 4
    weight = nn.Parameter(torch.tensor([3.0]))
    (weight.sum() * factor).backward()  # what the schedule's backward of one micro-batch's loss computes
    optimizer = torch.optim.SGD([weight], lr=1.0)
    plugin.scaler.unscale_(optimizer)
    assert weight.grad.tolist() == [0.25]  # d(loss / accumulate) / d weight, as without fp16
    bf16 = MixedPrecision("bf16-mixed", "cpu")
    assert loss_factor(bf16, accumulate_grad_batches=4, device=torch.device("cpu")) == 0.25
