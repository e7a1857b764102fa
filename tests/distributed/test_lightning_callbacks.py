"""What Lightning users already do, under every layout (issue 53): Lightning's ``grad_norm`` logged in
``on_before_optimizer_step`` and its ``EMAWeightAveraging`` callback, against one device training the same model
(float64, the recipe GPT).

Each job logs ``lightning.pytorch.utilities.grad_norm(self, norm_type=2)`` (imported before the run, as Lightning's docs
show) and ``lightning_parallel.grad_norm(self.model, "inf")`` on every rank at every optimizer step, trains with
``EMAWeightAveraging(decay=0.5)``, validates every 2 steps (the callback swaps the averaged weights in and back) and once
after fit (the module then holds the averaged weights). Every rank must log every parameter's whole-model norm under
its single-device name, the averaged parameters must be the single-device average, validation must see them, and
training must be unchanged by the swaps. Jobs run in the suite's 4-rank launch (``conftest.shared_specs``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch

from lightning_parallel.checkpoint.sharded import read_whole
from tests.equivalence import TOL, assert_same_training
from tests.harness import JobSpec, run_job

pytestmark = pytest.mark.distributed

STEPS = 4
LAYERS = 4
GLOBAL_BATCH = 8
DECAY = 0.5
SPLIT = ["model.blocks.2"]

#: name -> (strategy options, accumulate_grad_batches, checkpoint round trip). The round trip saves after fit and
#: validates from the file (the averaged weights are its state_dict; the module's own its current_model_state).
LAYOUTS = {
    # Tensor parallelism (DTensor parameters), replicas through FSDP2 with one-rank shards.
    "lightning_callbacks_dp2xtp2": ({"data_parallel_size": 2, "tensor_parallel_size": 2}, 1, False),
    # Tensor-parallel pipeline stages, tied embedding and head on different stages, a full-format checkpoint.
    "lightning_callbacks_tp2xpp2": (
        {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "split_points": SPLIT, "save_format": "full"}, 2, True,
    ),
    # Pipeline stages sharded over 2 data-parallel ranks, a sharded checkpoint.
    "lightning_callbacks_shard_dp2xpp2": (
        {"data_parallel_size": 2, "data_parallel_mode": "shard", "pipeline_parallel_size": 2, "split_points": SPLIT}, 1, True,
    ),
    # FSDP2 sharding (2 replicas x 2 shards), no tensor parallelism.
    "lightning_callbacks_hybrid_shard_2x2": (
        {"data_parallel_size": 4, "data_parallel_mode": "hybrid_shard", "data_parallel_shard_size": 2}, 1, False,
    ),
}


def job(devices: int = 1, strategy: dict | None = None, accumulate: int = 1, round_trip: bool = False) -> JobSpec:
    dp = (strategy or {}).get("data_parallel_size", 1)
    return JobSpec(
        strategy="hybrid" if strategy else "single", devices=devices, batch_size=GLOBAL_BATCH // dp, steps=STEPS,
        n_layer=LAYERS, accumulate=accumulate, validate=True, val_check_interval=2, grad_norm_logging=True, ema=DECAY,
        perturb_other_ranks=bool(strategy), checkpoint_round_trip=round_trip, strategy_kwargs=strategy or {},
    )


def four_rank_specs() -> dict[str, JobSpec]:
    """The 4-rank jobs (run in the suite's one 4-rank launch, ``conftest.four_rank_launch``)."""
    return {name: job(4, strategy, accumulate, round_trip) for name, (strategy, accumulate, round_trip) in LAYOUTS.items()}


@cache
def reference(accumulate: int) -> dict:
    return run_job(job(accumulate=accumulate))


@pytest.fixture(scope="module")
def launch(four_rank_launch):
    return four_rank_launch


def assert_same_norms(logged: list[dict[str, float]], expected: list[dict[str, float]], where: str) -> None:
    """Same names, and each norm equal to one device's relative to its own size (floor: 1e-9 of the step's total)."""
    assert len(logged) == len(expected) == STEPS, where
    for step, (actual, wanted) in enumerate(zip(logged, expected)):
        assert list(actual) == list(wanted), f"{where}, step {step + 1}: names {sorted(set(actual) ^ set(wanted))}"
        total = max(wanted.values())
        for name, value in wanted.items():
            assert actual[name] == pytest.approx(value, rel=1e-6, abs=1e-9 * total), f"{where}, step {step + 1}: {name}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lightning_grad_norm_is_the_whole_models_on_every_rank(name, launch):
    """Lightning's grad_norm(self, 2) (and the drop-in's inf norm of a submodule) log every parameter's whole gradient
    norm under its single-device name, tied weights once, and the total, on every rank: what one device logs."""
    results, _, _ = launch
    strategy, accumulate, _ = LAYOUTS[name]
    ref, result = reference(accumulate), results[name]
    assert len(result["grad_norms"]) == 4
    for rank in range(4):
        assert_same_norms(result["grad_norms"][rank], ref["grad_norms"][0], f"rank {rank}, 2-norm")
        assert_same_norms(result["grad_norms_inf"][rank], ref["grad_norms_inf"][0], f"rank {rank}, inf norm")
    # Lightning's own names: grad_2.0_norm/<parameter>, one per parameter with a gradient, and the total.
    first = result["grad_norms"][0][0]
    assert "grad_2.0_norm/model.tok_emb.weight" in first and "grad_2.0_norm_total" in first
    assert "grad_2.0_norm/model.lm_head.weight" not in first  # tied to the embedding: one entry, as on one device
    squares = sum(v * v for k, v in first.items() if not k.endswith("_total"))
    assert first["grad_2.0_norm_total"] == pytest.approx(math.sqrt(squares), rel=1e-9)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ema_weight_averaging_matches_single_device(name, launch):
    """EMAWeightAveraging: the averaged parameters are one device's, validation during fit (swapped in) and after it
    (copied in) sees them, and the swaps leave training as it was."""
    results, _, _ = launch
    strategy, accumulate, _ = LAYOUTS[name]
    ref, result = reference(accumulate), results[name]
    assert_same_training(ref, result, steps=STEPS)
    assert result["ema_params"].keys() == ref["ema_params"].keys()
    for param, value in ref["ema_params"].items():
        # One device averages in float32 (Lightning copies the module before converting it to float64); the layouts
        # in float64 (see lightning_parallel.strategies.weight_averaging): equal to float32's rounding.
        torch.testing.assert_close(result["ema_params"][param], value.double(), rtol=0, atol=TOL, msg=lambda m, p=param: f"{p}: {m}")
    assert len(result["val_losses"]) == len(ref["val_losses"]) == STEPS * accumulate // 2  # every 2 batches
    assert result["val_losses"] == pytest.approx(ref["val_losses"], abs=TOL)
    assert result["validation"]["val/loss"] == pytest.approx(ref["validation"]["val/loss"], abs=TOL)


@pytest.mark.parametrize("name", [name for name, (_, _, round_trip) in LAYOUTS.items() if round_trip])
def test_ema_checkpoint_holds_the_averaged_weights(name, launch):
    """A checkpoint written under the layout holds the averaged weights as its state_dict (whole tensors by the
    single-device names, in either format), the module's own under current_model_state, as Lightning writes them."""
    results, _, root = launch
    strategy, accumulate, _ = LAYOUTS[name]
    path = Path(root) / name / "final.ckpt"
    checkpoint = read_whole(path) if path.is_dir() else torch.load(path, weights_only=True)
    ref = reference(accumulate)
    assert {"current_model_state", "averaging_state"} <= checkpoint.keys()
    assert int(checkpoint["averaging_state"]["n_averaged"]) == STEPS  # one update per optimizer step
    for param, value in ref["ema_params"].items():
        torch.testing.assert_close(checkpoint["state_dict"][param], value.double(), rtol=0, atol=TOL, msg=lambda m, p=param: f"{p}: {m}")
    # Saved after fit: the module holds the averaged weights too (WeightAveraging copies them in at the end).
    for param, value in ref["ema_params"].items():
        torch.testing.assert_close(checkpoint["current_model_state"][param], value.double(), rtol=0, atol=TOL)
    assert results[name]["validation"]["val/loss"] == pytest.approx(ref["validation"]["val/loss"], abs=TOL)
