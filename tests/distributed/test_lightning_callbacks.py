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

import json
import math
from dataclasses import asdict
from functools import cache
from pathlib import Path

import pytest
import torch

from lightning_parallel.checkpoint.sharded import read_whole
from tests.checkpoint_worker import Run, run
from tests.equivalence import TOL, assert_same_training
from tests.harness import JobSpec, launch_module, run_job

pytestmark = pytest.mark.distributed

STEPS = 4
LAYERS = 4
GLOBAL_BATCH = 8
DECAY = 0.5
SPLIT = ["model.blocks.2"]

#: name -> (strategy options, accumulate_grad_batches, checkpoint round trip). The round trip saves after fit and
#: validates from the file (the averaged weights are its state_dict; the module's own its current_model_state).
LAYOUTS = {
    # Replicas (DDP): whole gradients and weights on every rank.
    "lightning_callbacks_dp4": ({"data_parallel_size": 4}, 1, False),
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
    _, accumulate, _ = LAYOUTS[name]
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
    _, accumulate, _ = LAYOUTS[name]
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
    _, accumulate, _ = LAYOUTS[name]
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


#: Resuming with EMA: saved mid-training (ModelCheckpoint at step 3 of 6, averaged and own weights differ), resumed
#: under another layout. name -> (strategy, per-rank batch, options of the saving run).
RESUME_LAYOUTS = {
    "tp2": ("tensor", 4, {}),  # sharded checkpoint
    "pp2": ("pipeline", 4, {"save_format": "full"}),
}
RESUME_STEPS, SAVED_AT = 6, 3
RESUME_MODEL = {"ema": DECAY, "n_layer": 2}


def resume_run(name: str, layout: str, root: Path, resume: str | None = None) -> Run:
    strategy, batch, options = RESUME_LAYOUTS.get(layout, ("single", 4, {}))
    saving = resume is None
    return Run(
        name=name, strategy=strategy, steps=RESUME_STEPS if not saving or layout == "single" else SAVED_AT, batch_size=batch,
        strategy_kwargs=options, resume=resume, model_kwargs=RESUME_MODEL,
        checkpoint_every=SAVED_AT if saving else None, checkpoint_dir=str(root / name) if saving else None,
    )


def assert_continues(resumed: dict, ref: dict) -> None:
    torch.testing.assert_close(resumed["step_losses"], ref["step_losses"][SAVED_AT:], atol=TOL, rtol=0)
    for name, value in ref["final_state"].items():
        torch.testing.assert_close(resumed["final_state"][name], value, atol=TOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    for name, value in ref["ema_params"].items():
        torch.testing.assert_close(resumed["ema_params"][name].double(), value.double(), atol=TOL, rtol=0, msg=lambda m, n=name: f"EMA {n}: {m}")


def test_ema_resumes_across_layouts_and_on_one_device(tmp_path):
    """A checkpoint saved mid-training under tp2 (sharded) or pp2 (full) holds one device's averaged weights as its
    state_dict; resumed under the other layout, and on one device with Lightning's own strategy, training and the
    average continue as one device's uninterrupted run."""
    ref = run(resume_run("single", "single", tmp_path), devices=1)
    runs = [resume_run(layout, layout, tmp_path) for layout in RESUME_LAYOUTS]
    runs += [resume_run(f"{a}->{b}", b, tmp_path, str(tmp_path / a / f"step={SAVED_AT}.ckpt")) for a, b in (("tp2", "pp2"), ("pp2", "tp2"))]
    plan = {"devices": 2, "result": str(tmp_path / "result.pt"), "runs": [asdict(r) for r in runs]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = launch_module(["tests.checkpoint_worker", str(tmp_path / "plan.json")], timeout=600, nproc=2)
    assert proc.returncode == 0, f"job failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    results = torch.load(plan["result"], weights_only=False)
    saved_ref = torch.load(tmp_path / "single" / f"step={SAVED_AT}.ckpt", weights_only=False)
    weight = "model.blocks.0.attn.q_proj.weight"  # mid-training the average is not the module's own weights
    assert (saved_ref["state_dict"][weight].double() - saved_ref["current_model_state"][weight]).abs().max() > 1e-4
    for layout in RESUME_LAYOUTS:
        path = tmp_path / layout / f"step={SAVED_AT}.ckpt"
        saved = read_whole(path) if path.is_dir() else torch.load(path, weights_only=True)
        for key in ("state_dict", "current_model_state"):  # the averaged weights; the module's own
            for name, value in saved_ref[key].items():
                where = f"{layout} {key} {name}"
                torch.testing.assert_close(saved[key][name].double(), value.double(), atol=TOL, rtol=0, msg=lambda m, w=where: f"{w}: {m}")
    for pair in ("tp2->pp2", "pp2->tp2"):
        assert_continues(results[pair], ref)
    # Lightning's own WeightAveraging on one device reads the sharded checkpoint (through ParallelCheckpointIO).
    assert_continues(run(resume_run("tp2->single", "single", tmp_path, str(tmp_path / "tp2" / f"step={SAVED_AT}.ckpt")), devices=1), ref)
