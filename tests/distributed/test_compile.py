"""``compile=true``: each block compiled with torch.compile (inductor on the CPU), exactly single-device training.

Compilation on two cores is slow: the jobs of each world size share one launch, with a tiny GPT. The
8-rank dp2 × tp2 × pp2 job compiles the stages' blocks with the same options.
"""

from __future__ import annotations

import json
from functools import cache

import pytest
import yaml

from lightning_parallel.observe.utilization import check_mfu
from tests.distributed.test_data_parallel import assert_same_training
from tests.harness import JobSpec, run_distributed_jobs, run_job

pytestmark = pytest.mark.distributed

STEPS = 3
COMPILE = {"compile": True}


@cache
def reference(batch_size: int, accumulate: int = 1) -> dict:
    return run_job(JobSpec(batch_size=batch_size * accumulate, steps=STEPS))


def test_compiled_blocks_train_exactly_like_eager_single_device(tmp_path):
    jobs = {
        "dp2_accumulate2": (JobSpec(strategy="data", devices=2, batch_size=2, accumulate=2, steps=STEPS, strategy_kwargs=COMPILE), (4, 2)),
        "tp2": (JobSpec(strategy="tensor", devices=2, steps=STEPS, strategy_kwargs={**COMPILE, "data_parallel_mode": "replicate"}), (4,)),
        "pp2_accumulate2": (
            JobSpec(strategy="pipeline", devices=2, accumulate=2, steps=STEPS, strategy_kwargs={**COMPILE, "microbatches": 2}), (4, 2)
        ),
        "dp2_first_block_eager": (
            JobSpec(strategy="data", devices=2, batch_size=2, steps=STEPS, strategy_kwargs={**COMPILE, "compile_exclude": ["model.blocks.0"]}),
            (4,),
        ),
    }
    results = run_distributed_jobs({name: job for name, (job, _) in jobs.items()}, tmp_path, timeout=900)
    for name, (_, reference_arguments) in jobs.items():
        try:
            assert_same_training(reference(*reference_arguments), results[name], steps=STEPS)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
        # Checkpoints and state dicts keep the module's own names.
        assert not any("_orig_mod" in n for n in results[name]["states"][0]), name
        assert results[name]["compiled_blocks"], name
    assert results["dp2_accumulate2"]["compiled_blocks"] == ["model.blocks.0", "model.blocks.1"]
    assert results["dp2_first_block_eager"]["compiled_blocks"] == ["model.blocks.1"]
    assert results["pp2_accumulate2"]["compiled_blocks"]  # this rank's stage's blocks


def test_gpu_check_runs_on_the_cpu_as_a_smoke_test(tmp_path):
    """benchmarks/gpu_check.py --smoke: Lightning's single device, ours eager, and ours compiled with activation
    checkpointing train a tiny model for 2 steps and report step time, the monitor's step time, tokens/s, an MFU in
    (0, 1] and the predicted peak memory; two layouts at 2 ranks on the one device match the single device."""
    from benchmarks.gpu_check import SMOKE_VARIANTS, main
    from benchmarks.gpu_layouts import SMOKE_LAYOUTS

    assert main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_check_smoke.json").read_text())
    assert set(results["variants"]) == set(SMOKE_VARIANTS)
    for variant, result in results["variants"].items():
        assert result["step_s"] > 0 and result["tokens_per_s"] > 0, variant
        assert result["monitor_step_s"] > 0 and result["predicted_peak_memory_gib"] > 0, variant
        check_mfu(result["mfu"], variant)
        assert result["mfu"] > 0, variant
    assert set(results["layouts"]) == set(SMOKE_LAYOUTS)
    assert all(r["match"] and r["world_size"] == 2 for r in results["layouts"].values()), results["layouts"]
    report = (tmp_path / "gpu_check_smoke.md").read_text()
    assert "| ours + compile + activation checkpointing |" in report and "| pp2 (" in report
    # The planner's calibration: the profile again, with the measured MFU as its achievable fraction.
    calibrated = yaml.safe_load((tmp_path / "cpu_local_calibrated.yaml").read_text())
    assert calibrated["name"] == "cpu_local_calibrated" and calibrated["measured"] is True
    assert calibrated["achievable_fraction"] == pytest.approx(results["variants"]["ours DataParallelStrategy"]["mfu"], abs=1e-4)
