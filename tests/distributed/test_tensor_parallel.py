"""TensorParallelStrategy reproduces single-device training of the recipe GPT (float64), with no module changes."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_data_parallel import TOL, assert_same_training
from tests.harness import JobSpec, run_distributed, run_job

pytestmark = pytest.mark.distributed

STEPS = 5


@pytest.mark.parametrize("accumulate", [1, 2], ids=["tp2", "tp2-accumulate2"])
def test_auto_plan_matches_single_device(accumulate, tmp_path):
    # TP peers read the same batches: the global batch is the per-rank batch.
    reference = run_job(JobSpec(batch_size=4 * accumulate, steps=STEPS, validate=accumulate == 1))
    result = run_distributed(
        JobSpec(strategy="tensor", devices=2, batch_size=4, accumulate=accumulate, steps=STEPS, validate=accumulate == 1),
        tmp_path,
    )
    assert_same_training(reference, result)
    # Split layers hold half of their weights per rank; embeddings and norms stay whole.
    assert result["local_param_numel"] < 0.8 * sum(v.numel() for k, v in reference["states"][0].items())
    if accumulate == 1:
        assert result["synced_logs"] == pytest.approx(reference["synced_logs"], abs=TOL)
        for key in ("val/loss", "val/accuracy"):
            assert result["validation"][key] == pytest.approx(reference["validation"][key], abs=TOL), key


def test_explicit_plan_by_pattern(tmp_path):
    plan = {"model.blocks.*.mlp.fc_in": "colwise", "model.blocks.*.mlp.fc_out": "rowwise"}
    reference = run_job(JobSpec(batch_size=4, steps=3))
    result = run_distributed(JobSpec(strategy="tensor", devices=2, batch_size=4, steps=3, strategy_kwargs={"plan": plan}), tmp_path)
    assert_same_training(reference, result, steps=3)
