"""assert_same_training catches the bugs a layout can have: a gradient scaled by 2, a shard dropped, a micro-batch skipped.

One single-device run (float64, 2 micro-batches per step, 3 steps) in this process is the reference; broken copies of
it, and a real run whose one micro-batch's gradient never reaches the weights, must each be refused, while the
identical copy passes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.equivalence import GRAD_FLOOR, assert_same_training
from tests.harness import JobSpec, build, run_job

STEPS = 3
SPEC = JobSpec(batch_size=4, accumulate=2, steps=STEPS)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return run_job(SPEC)


def signal(tensors: dict[str, torch.Tensor], name: str) -> bool:
    """Whether a tensor is more than rounding noise around zero (a key projection's bias gradient is ~1e-21:
    attention does not depend on it, so no layout can be told apart by it)."""
    scale = max(float(t.abs().max()) for t in tensors.values())
    return float(tensors[name].abs().max()) > 1e3 * GRAD_FLOOR * scale


def refused(reference: dict, broken: dict) -> bool:
    try:
        assert_same_training(reference, broken, steps=STEPS)
    except AssertionError:
        return True
    return False


def test_an_identical_copy_passes(reference):
    assert_same_training(reference, copy.deepcopy(reference), steps=STEPS)


@pytest.mark.parametrize("kind", ["grads", "states"])
def test_any_one_tensor_scaled_by_two_is_caught(reference, kind):
    """Every tensor at every step, one at a time: including the query/key gradients, 1e-7 after a few steps."""
    missed = []
    for step in range(STEPS):
        for name in reference[kind][step]:
            if not signal(reference[kind][step], name):
                continue
            broken = copy.copy(reference)
            broken[kind] = [dict(s) for s in reference[kind]]
            broken[kind][step][name] = 2 * reference[kind][step][name]
            if not refused(reference, broken):
                missed.append((step + 1, name, float(reference[kind][step][name].abs().max())))
    assert not missed, f"{kind} doubled but not caught: {missed}"


@pytest.mark.parametrize("kind", ["grads", "states"])
def test_any_one_dropped_shard_is_caught(reference, kind):
    """Half a tensor (one of two tensor- or data-parallel shards along its first dimension) left at zero."""
    missed = []
    for step in range(STEPS):
        for name, tensor in reference[kind][step].items():
            if not tensor.is_floating_point() or tensor.numel() < 2:
                continue
            flat = tensor.reshape(-1) if tensor.shape[0] < 2 else tensor
            for half in (slice(None, flat.shape[0] // 2), slice(flat.shape[0] // 2, None)):
                if not signal({**reference[kind][step], name: flat[half]}, name):
                    continue
                dropped = flat.clone()
                dropped[half] = 0
                broken = copy.copy(reference)
                broken[kind] = [dict(s) for s in reference[kind]]
                broken[kind][step][name] = dropped.reshape(tensor.shape)
                if not refused(reference, broken):
                    missed.append((step + 1, name, half, float(flat[half].abs().max())))
    assert not missed, f"{kind} with a shard zeroed but not caught: {missed}"


def test_a_skipped_micro_batch_is_caught(reference):
    """A real run in which step 2's second micro-batch is computed (its loss is logged) but its backward never
    reaches the weights, as a pipeline that drops one micro-batch's gradient would."""
    model, data, trainer, recorder = build(SPEC)
    training_step = model.training_step

    def skipping(batch, batch_idx):
        loss = training_step(batch, batch_idx)
        return loss.detach().requires_grad_() if batch_idx == 3 else loss

    model.training_step = skipping
    trainer.fit(model, datamodule=data)
    skipped = recorder.result
    assert refused(reference, skipped)
    # Up to step 2 the losses are all there and equal: the gradients show it.
    torch.testing.assert_close(skipped["step_losses"][:2], reference["step_losses"][:2], rtol=0, atol=1e-12)
    first_two = [{**run, **{key: run[key][:2] for key in ("step_losses", "grads", "states")}} for run in (reference, skipped)]
    with pytest.raises(AssertionError, match="grads of .* after step 2"):
        assert_same_training(*first_two, steps=2)


def test_a_missing_step_or_tensor_is_caught(reference):
    fewer = copy.copy(reference)
    fewer["grads"] = reference["grads"][:-1]
    assert refused(reference, fewer)
    missing = copy.copy(reference)
    missing["states"] = [dict(s) for s in reference["states"]]
    missing["states"][0].pop(next(iter(missing["states"][0])))
    assert refused(reference, missing)
