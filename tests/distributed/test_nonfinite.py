"""A NaN loss on one rank is seen by every rank at once: ``nonfinite="error"`` stops naming the step and the
ranks, ``"skip"`` skips that optimizer step everywhere — replicas and stages never drift apart."""

from __future__ import annotations

import math

import pytest
import torch

from tests.harness import JobSpec, launch_worker, run_distributed_jobs

pytestmark = pytest.mark.distributed

NAN_STEP = 2
LAYOUTS = {
    "dp2": {"strategy": "data", "strategy_kwargs": {}},
    "pp2": {"strategy": "pipeline", "strategy_kwargs": {"pipeline_parallel_size": 2, "microbatches": 2}},
}


def spec(layout: str, mode: str) -> JobSpec:
    config = LAYOUTS[layout]
    return JobSpec(
        strategy=config["strategy"], devices=2, steps=4, nan_rank=1, nan_step=NAN_STEP,
        strategy_kwargs={**config["strategy_kwargs"], "nonfinite": mode, "timeout": 60},
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_error_stops_every_rank_naming_step_and_ranks(layout, tmp_path):
    proc = launch_worker(spec(layout, "error"), tmp_path, timeout=180)
    assert proc.returncode != 0
    message = proc.stdout + proc.stderr
    assert f"Non-finite values (NaN or Inf) at optimizer step {NAN_STEP}: loss on rank(s) [" in message
    assert "1]" in message and "nonfinite='skip'" in message


def test_skip_skips_the_step_on_every_rank(tmp_path):
    results = run_distributed_jobs({layout: spec(layout, "skip") for layout in LAYOUTS}, tmp_path)
    for layout, result in results.items():
        states = result["states"]
        assert len(states) == 4, layout
        # The poisoned step changed nothing; the steps around it did, and stayed finite.
        for name, before in states[NAN_STEP - 1].items():
            assert torch.equal(states[NAN_STEP][name], before), (layout, name)
        assert any(not torch.equal(states[NAN_STEP + 1][n], v) for n, v in states[NAN_STEP].items()), layout
        assert all(torch.isfinite(t).all() for state in states for t in state.values()), layout
        assert result["replica_spread"] == 0.0, layout
        losses = result["step_losses"].tolist()
        assert math.isnan(losses[NAN_STEP]) and all(math.isfinite(v) for i, v in enumerate(losses) if i != NAN_STEP), layout
