"""DataParallelStrategy reproduces single-device training (float64), and communicates only when it must."""

from __future__ import annotations

import pytest
import torch

from tests.comm_hooks_check import (
    assert_compressed_hook_gradients,
    assert_powersgd_hook_gradients,
    mutated,
    replay_replica_grads,
)
from tests.equivalence import TOL, assert_same_training
from tests.harness import JobSpec, run_distributed, run_distributed_jobs, run_job
from tests.planner_check import (
    assert_planner_predicts_communication,
    assert_planner_predicts_state,
)

pytestmark = pytest.mark.distributed

STEPS = 5
PER_RANK_BATCH = 4


def assert_one_allreduce_round_per_step(result: dict, steps: int = STEPS) -> None:
    comm = result["comm"]
    assert comm["rounds"] == steps, f"expected {steps} gradient all-reduce rounds, counted {comm}"
    # Each round moves every gradient exactly once (DDP may regroup buckets after the first step).
    assert comm["bytes"] == steps * result["param_bytes"]


# Small buckets (several all-reduces per round) and gradients that alias the buckets.
BUCKET_OPTIONS = {"bucket_cap_mb": 0.02, "gradient_as_bucket_view": True}


VARIANTS = {
    "dp2": (2, 1, {}),
    "dp4-static-graph": (4, 1, {"static_graph": True}),
    "dp2-accumulate2": (2, 2, {}),
    "dp2-accumulate4-small-buckets": (2, 4, BUCKET_OPTIONS),
}

#: Lossy gradient compression (bf16 needs NCCL): checked step by step against a float64 replay, not single device.
HOOKS = {
    "fp16": {"comm_hook": "fp16"},
    "powersgd": {"comm_hook": "powersgd", "powersgd_rank": 1, "powersgd_start_iter": 2},
}


def variant_spec(devices: int, accumulate: int, options: dict) -> JobSpec:
    return JobSpec(
        strategy="data", devices=devices, batch_size=PER_RANK_BATCH, accumulate=accumulate, steps=STEPS,
        validate=devices == 2 and accumulate == 1, strategy_kwargs=options, monitor=devices == 2,
    )


def hook_spec(hook: str) -> JobSpec:
    return JobSpec(strategy="data", devices=2, batch_size=PER_RANK_BATCH, steps=STEPS, strategy_kwargs=dict(HOOKS[hook]))


@pytest.fixture(scope="module")
def two_rank_variants(tmp_path_factory):
    """The 2-rank variants and compression hooks one after another in one launch (starting processes is the slow
    part here)."""
    specs = {name: variant_spec(*variant) for name, variant in VARIANTS.items() if variant[0] == 2}
    specs.update({f"hook-{hook}": hook_spec(hook) for hook in HOOKS})
    return run_distributed_jobs(specs, tmp_path_factory.mktemp("dp2"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpt_matches_single_device_with_the_global_batch(variant, request, tmp_path):
    devices, accumulate, options = VARIANTS[variant]
    validate = devices == 2 and accumulate == 1
    reference = run_job(JobSpec(batch_size=PER_RANK_BATCH * devices * accumulate, steps=STEPS, validate=validate))
    if devices == 2:
        result = request.getfixturevalue("two_rank_variants")[variant]
    else:
        result = run_distributed(variant_spec(devices, accumulate, options), tmp_path)
    assert result["world_size"] == devices
    assert_same_training(reference, result)
    # Accumulation skips the all-reduce on the k-1 intermediate micro-batches.
    assert_one_allreduce_round_per_step(result)
    # The planner's memory model: every replica holds the whole state; the monitor counts what DDP sends.
    spec = variant_spec(devices, accumulate, options)
    assert_planner_predicts_state(spec, result)
    if spec.monitor:
        assert_planner_predicts_communication(spec, result, ("dp",))
    if options is BUCKET_OPTIONS:
        # DDP's first step uses one 1 MB bucket, then rebuilds buckets of bucket_cap_mb.
        assert result["comm"]["bucket_calls"] > 2 * STEPS, "small buckets should split each round"
    if validate:
        # self.log(sync_dist=True) per step, and torchmetrics/sync_dist over the validation set.
        assert result["synced_logs"] == pytest.approx(reference["synced_logs"], abs=TOL)
        assert len(result["synced_logs"]) == STEPS
        for key in ("val/loss", "val/accuracy"):
            assert result["validation"][key] == pytest.approx(reference["validation"][key], abs=TOL), key


@pytest.mark.parametrize("launch", ["spawn", "torchrun"])
def test_other_launchers_train_the_same(launch, tmp_path):
    """start_method="spawn" (notebooks, tests) and an external launcher (torchrun) detected by Lightning."""
    reference = run_job(JobSpec(batch_size=PER_RANK_BATCH * 2, steps=3))
    spec = JobSpec(strategy="data", devices=2, batch_size=PER_RANK_BATCH, steps=3)
    if launch == "spawn":
        spec.strategy_kwargs = {"start_method": "spawn"}
    result = run_distributed(spec, tmp_path, torchrun=launch == "torchrun")
    assert result["world_size"] == 2
    assert_same_training(reference, result, steps=3)


@pytest.mark.parametrize("switch", ["trainer", "strategy"])
def test_sync_batchnorm_matches_single_device(switch, tmp_path):
    reference = run_job(JobSpec(model="convnet", batch_size=16, steps=STEPS))
    spec = JobSpec(model="convnet", strategy="data", devices=2, batch_size=8, steps=STEPS)
    if switch == "trainer":
        spec.trainer_sync_batchnorm = True
    else:
        spec.strategy_kwargs = {"sync_batchnorm": True}
    result = run_distributed(spec, tmp_path)
    # The states include BatchNorm's running mean/var: they too follow the global batch.
    assert any("running_var" in name for name in result["states"][0])
    assert_same_training(reference, result)


def test_without_sync_batchnorm_replicas_normalize_with_their_own_statistics(tmp_path):
    """The seed's point: under DP, BatchNorm sees only the local slice, so training differs."""
    reference = run_job(JobSpec(model="convnet", batch_size=16, steps=STEPS))
    result = run_distributed(JobSpec(model="convnet", strategy="data", devices=2, batch_size=8, steps=STEPS), tmp_path)
    first_loss_gap = abs(float(result["step_losses"][0] - reference["step_losses"][0]))
    # Same weights and samples at step 1, but per-slice statistics already change the loss.
    assert first_loss_gap > 1e-4
    grad_gap = max(
        float((result["grads"][0][name] - reference["grads"][0][name]).abs().max()) for name in reference["grads"][0]
    )
    assert grad_gap > 1e-4


@pytest.mark.parametrize("hook", list(HOOKS))
def test_compression_hooks_reduce_to_the_exact_average_within_their_rounding(hook, two_rank_variants):
    """Each step's reduced gradients against a float64 replay of that step at the run's own weights (see
    tests/comm_hooks_check.py): fp16 within its rounding of the exact average, PowerSGD exact before its start and
    for what it does not compress, then the rank-1 projection of the gradient plus its error memory."""
    spec, result = hook_spec(hook), two_rank_variants[f"hook-{hook}"]
    assert result["comm"]["rounds"] == STEPS
    assert result["replica_spread"] <= 1e-12
    replicas = replay_replica_grads(spec, result)
    if hook == "fp16":
        check = lambda run: assert_compressed_hook_gradients(run, replicas, torch.float16)  # noqa: E731
        found = check(result)
        assert found["max_error"] > 0, "the fp16 hook reduced exactly: did it compress at all?"
    else:
        options = HOOKS[hook]
        check = lambda run: assert_powersgd_hook_gradients(run, replicas, options["powersgd_rank"], options["powersgd_start_iter"])  # noqa: E731
        found = check(result)
        assert found["compression_gap"] > 1e-3, f"PowerSGD's gradients are the exact ones: did it compress? {found}"
    # The check fails for a broken hook: gradients zeroed, negated or doubled at one (compressed) step.
    for how in ("zeroed", "negated", "doubled"):
        with pytest.raises(AssertionError):
            check(mutated(result, STEPS - 1, how))
