"""Local SGD and DiLoCo: every step against the algorithms written out in plain torch (tests/periodic_sync_reference.py),
the exact special cases, replicas between and at synchronizations, collective counts."""

from __future__ import annotations

import pytest
import torch

import lightning_parallel
from tests.distributed.test_data_parallel import TOL
from tests.harness import JobSpec, run_distributed_jobs
from tests.periodic_sync_reference import periodic_sync_reference

pytestmark = pytest.mark.distributed

STEPS = 6


def job(steps: int = STEPS, accumulate: int = 1, precision: str = "64-true", **sync) -> JobSpec:
    # The regressor trains with plain SGD: averaging parameters after local SGD steps equals averaging gradients.
    return JobSpec(model="regressor", strategy="data", devices=2, batch_size=8, steps=steps, accumulate=accumulate,
                   precision=precision, strategy_kwargs=sync)


JOBS = {
    "every_step": job(),
    "local_sgd_h1": job(sync="local_sgd", sync_every=1),
    "diloco_h1": job(sync="diloco", sync_every=1, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False),
    "local_sgd_h3_at_sync": job(sync="local_sgd", sync_every=3),
    "local_sgd_h3_between": job(steps=STEPS - 1, sync="local_sgd", sync_every=3),
    "local_sgd_h2_warmup2": job(sync="local_sgd", sync_every=2, sync_warmup_steps=2),
    "diloco_h3": job(sync="diloco", sync_every=3),
    "every_step_accumulate2": job(steps=4, accumulate=2),
    "diloco_h3_bf16": job(precision="bf16-true", sync="diloco", sync_every=3),
    "diloco_h1_accumulate2": job(steps=4, accumulate=2, sync="diloco", sync_every=1, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed_jobs(JOBS, tmp_path_factory.mktemp("sync"))


def assert_same_states(result: dict, reference: dict) -> None:
    for actual, expected in zip(result["states"], reference["states"], strict=True):
        for name in expected:
            torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=TOL)


@pytest.mark.parametrize(("name", "reference"), [("local_sgd_h1", "every_step"), ("diloco_h1", "every_step"),
                                                 ("diloco_h1_accumulate2", "every_step_accumulate2")])
def test_exact_special_cases_equal_synchronous_data_parallelism(name, reference, results):
    assert_same_states(results[name], results[reference])
    assert results[name]["replica_spread"] <= 1e-12


#: job -> the reference's arguments (DiLoCo: the strategy's defaults, outer lr 0.7, Nesterov momentum 0.9).
AGAINST_REFERENCE = {
    "local_sgd_h3_at_sync": {"steps": STEPS, "sync_every": 3},
    "local_sgd_h3_between": {"steps": STEPS - 1, "sync_every": 3},
    "local_sgd_h2_warmup2": {"steps": STEPS, "sync_every": 2, "warmup": 2},
    "diloco_h3": {"steps": STEPS, "sync_every": 3, "diloco": (0.7, 0.9, True)},
}


@pytest.mark.parametrize("name", list(AGAINST_REFERENCE))
def test_every_step_equals_the_algorithm_written_from_its_paper(name, results):
    """Rank 0's parameters after every step (local steps and synchronizations) equal the plain-torch reference's
    replica 0 (float64; they agree to ~1e-16). The same reference with a wrong detail (synchronous every step,
    DiLoCo with plain instead of Nesterov momentum) is far from the run: the comparison can fail."""
    kwargs = AGAINST_REFERENCE[name]
    states = results[name]["states"]
    expected = periodic_sync_reference(**kwargs)
    assert len(states) == len(expected) == kwargs["steps"]
    for step, (actual, reference) in enumerate(zip(states, expected, strict=True)):
        assert actual.keys() == reference.keys()
        for param, value in reference.items():
            torch.testing.assert_close(actual[param], value, rtol=0, atol=1e-12, msg=lambda m, s=step, p=param: f"step {s + 1} {p}: {m}")
    wrong = (periodic_sync_reference(**{**kwargs, "diloco": (0.7, 0.9, False)}) if "diloco" in kwargs
             else periodic_sync_reference(kwargs["steps"], sync_every=1))
    assert max(float((states[-1][p] - v).abs().max()) for p, v in wrong[-1].items()) > 1e-6


def test_replicas_agree_right_after_a_sync_and_differ_between(results):
    assert results["local_sgd_h3_at_sync"]["replica_spread"] <= 1e-12  # step 6: a sync step
    assert results["local_sgd_h3_between"]["replica_spread"] > 1e-6  # step 5: two local steps since the sync
    assert results["diloco_h3"]["replica_spread"] <= 1e-12
    # bf16 weights: the averaged replicas agree exactly too, and training stays finite.
    assert results["diloco_h3_bf16"]["replica_spread"] == 0
    assert results["diloco_h3_bf16"]["step_losses"].isfinite().all()


def test_collectives_per_period(results):
    # Every step: one gradient all-reduce per step. Local SGD: one parameter all-reduce per period, after the
    # synchronous warm-up steps (each one gradient all-reduce).
    assert results["every_step"]["comm"]["rounds"] == STEPS
    assert results["local_sgd_h3_at_sync"]["comm"]["rounds"] == STEPS // 3
    assert results["local_sgd_h2_warmup2"]["comm"]["rounds"] == 2 + (STEPS - 2) // 2
    assert results["diloco_h3"]["comm"]["rounds"] == STEPS // 3


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sync": "local_sgd", "sync_every": 0}, ValueError, "sync_every=0 must be an int >= 1"),
        ({"sync": "gossip"}, ValueError, "sync='gossip' is unknown"),
        ({"sync": "every_step", "sync_every": 4}, ValueError, "apply to sync='local_sgd' or 'diloco'"),
        ({"sync": "diloco", "outer_momentum": 0.0}, ValueError, "outer_nesterov=True needs outer_momentum > 0"),
        ({"sync": "diloco", "sync_every": 4, "data_parallel_mode": "shard"}, ValueError, "does not combine with data_parallel_mode='shard'"),
        ({"sync": "local_sgd", "sync_every": 4, "tensor_parallel_size": 2}, ValueError, "does not combine with tensor_parallel_size=2"),
    ],
)
def test_bad_sync_settings_fail_early(kwargs, error, match):
    import lightning as L

    with pytest.raises(error, match=match):
        L.Trainer(accelerator="cpu", devices=4, strategy=lightning_parallel.HybridParallelStrategy(**kwargs), logger=False)


@pytest.mark.parametrize("sync", [{"sync": "local_sgd", "sync_every": 3}, {"sync": "diloco", "sync_every": 3}], ids=["local_sgd", "diloco"])
def test_resume_mid_period_continues_exactly(sync, tmp_path):
    """Saved at step 4 (one local step after the sync at 3), resumed: steps 5 and 6 as if never stopped."""
    import json

    from tests.harness import launch_module

    # The recipe GPT: its loader (torchdata's StatefulDataLoader) resumes mid-epoch at the next batch.
    base = {"strategy": "data", "batch_size": 4, "strategy_kwargs": sync}
    runs = [
        {**base, "name": "straight", "steps": STEPS, "checkpoint_every": 2, "checkpoint_dir": str(tmp_path / "ckpt")},
        {**base, "name": "resumed", "steps": STEPS, "resume": str(tmp_path / "ckpt" / "step=4.ckpt")},
    ]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"devices": 2, "runs": runs, "result": str(tmp_path / "result.pt")}))
    proc = launch_module(["tests.checkpoint_worker", str(plan)], timeout=300, nproc=2)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = torch.load(tmp_path / "result.pt", weights_only=False)
    straight, resumed = results["straight"], results["resumed"]
    torch.testing.assert_close(resumed["step_losses"], straight["step_losses"][4:], rtol=0, atol=0)
    for name, value in straight["final_state"].items():
        torch.testing.assert_close(resumed["final_state"][name], value, rtol=0, atol=0, msg=name)
