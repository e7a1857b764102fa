"""PipelineParallelStrategy reproduces single-device training of the recipe GPT (float64), for every schedule."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_data_parallel import TOL, assert_same_training
from tests.distributed.test_tensor_parallel import assert_checkpoint_holds_whole_tensors
from tests.harness import (
    JobSpec,
    launch_worker,
    run_distributed,
    run_distributed_jobs,
    run_job,
)
from tests.planner_check import assert_planner_predicts_state

pytestmark = pytest.mark.distributed

STEPS = 5
BATCH = 8
LAYERS = 4  # two virtual stages on each of two ranks need four blocks

MANY_MICROBATCHES = "gpipe_16_microbatches"

SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("looped_bfs", 2),
    ("interleaved_zero_bubble", 2),
    ("zbv_zero_bubble", 2),
    ("dualpipev", 2),
]


@pytest.fixture(scope="module")
def reference():
    return run_job(JobSpec(batch_size=BATCH, steps=STEPS, n_layer=LAYERS, validate=True, predict=True))


@pytest.fixture(scope="module")
def schedule_results(tmp_path_factory):
    """Every schedule's job, one after another in one 2-process launch."""
    specs = {}
    for schedule, stages_per_rank in SCHEDULES:
        round_trip = schedule == "1f1b"
        # With Lightning's default sanity check the pipeline is built from a validation batch, in inference mode.
        sanity = 2 if schedule == "interleaved_1f1b" else 0
        specs[schedule] = JobSpec(
            strategy="pipeline", devices=2, batch_size=BATCH, steps=STEPS, n_layer=LAYERS, validate=True,
            checkpoint_round_trip=round_trip, predict=round_trip, sanity_val_steps=sanity,
            strategy_kwargs={"pipeline_parallel_size": 2, "schedule": schedule, "stages_per_rank": stages_per_rank, "microbatches": 4},
            monitor=schedule == "1f1b",
            count_host_syncs=schedule == "gpipe",
        )
    # The same pipeline with 16 one-row micro-batches (batch 16): a step's host syncs and collectives must not grow.
    specs[MANY_MICROBATCHES] = JobSpec(
        strategy="pipeline", devices=2, batch_size=16, steps=3, n_layer=LAYERS, count_host_syncs=True,
        strategy_kwargs={"pipeline_parallel_size": 2, "schedule": "gpipe", "microbatches": 16},
    )
    root = tmp_path_factory.mktemp("schedules")
    return root, specs, run_distributed_jobs(specs, root)


@pytest.mark.parametrize("schedule", [schedule for schedule, _ in SCHEDULES])
def test_every_schedule_matches_single_device(schedule, reference, schedule_results):
    root, specs, results = schedule_results
    result, round_trip = results[schedule], schedule == "1f1b"
    assert_same_training(reference, result)
    # The planner puts the same layers on stage 0 as the split does.
    assert_planner_predicts_state(specs[schedule], result)
    # The module's own self.log calls (micro-batch values combined) and validation equal single device.
    assert result["synced_logs"] == pytest.approx(reference["synced_logs"], abs=TOL)
    for key in ("val/loss", "val/accuracy"):
        assert result["validation"][key] == pytest.approx(reference["validation"][key], abs=TOL), key
    # Stage 0 holds half the blocks plus the embeddings, not the whole model.
    assert result["param_bytes"] < 0.6 * reference["param_bytes"]
    if round_trip:
        # trainer.predict runs through the pipeline too; every rank returns the predictions.
        torch.testing.assert_close(result["predictions"], reference["predictions"], rtol=0, atol=TOL)
        # Written by both stages (sharded), read whole it loads into the plain module; validated from it above.
        assert_checkpoint_holds_whole_tensors(root / schedule / "final.ckpt", reference["states"][-1], n_layer=LAYERS)


def test_host_syncs_and_collectives_per_step_do_not_grow_with_microbatches(schedule_results):
    """pp2 GPipe with 4 and with 16 micro-batches: every rank makes the same host reads of tensor values
    (``item``, ``bool``, ``int``, ``tolist``, ...) and the same collectives in each training step after the first.
    The last stage's results reach the other stage as one byte tensor (no pickled objects once the structure is
    known), and the loss function finds its micro-batch without reading a tensor."""
    _, _, results = schedule_results
    few, many = results["gpipe"]["step_counts"], results[MANY_MICROBATCHES]["step_counts"]
    assert len(few) == len(many) == 2  # ranks
    for rank in range(2):
        expected = few[rank][0]
        assert all(counts == expected for counts in few[rank] + many[rank]), (rank, few[rank], many[rank])
        assert "broadcast_object_list" not in expected and "__int__" not in expected, expected
        assert expected.get("broadcast") == 1, expected  # the last stage's loss and logs
    # One-row micro-batches train the same model as one device with the whole batch.
    assert_same_training(run_job(JobSpec(batch_size=16, steps=3, n_layer=LAYERS)), results[MANY_MICROBATCHES], steps=3)


def test_data_parallel_replicas_of_a_pipeline_with_accumulation_and_clipping(tmp_path):
    """pp=2 × dp=2 on 4 ranks, 2 micro-batches, accumulate 2, clipping: one device with the 2·2× batch."""
    reference = run_job(JobSpec(batch_size=4 * 2 * 2, steps=STEPS, n_layer=LAYERS, gradient_clip_val=0.05))
    result = run_distributed(
        JobSpec(
            strategy="pipeline", devices=4, batch_size=4, accumulate=2, steps=STEPS, n_layer=LAYERS, gradient_clip_val=0.05,
            perturb_other_ranks=True, strategy_kwargs={"pipeline_parallel_size": 2, "microbatches": 2},
        ),
        tmp_path,
    )
    assert result["world_size"] == 4
    assert_same_training(reference, result)
    # Replicas average gradients once per optimizer step, not once per micro-step.
    assert result["comm"]["rounds"] == STEPS


def test_explicit_split_points_and_time_balance(tmp_path):
    reference = run_job(JobSpec(batch_size=BATCH, steps=3, n_layer=LAYERS))
    for options in ({"split_points": ["model.blocks.1"]}, {"balance": "time"}):
        result = run_distributed(
            JobSpec(strategy="pipeline", devices=2, batch_size=BATCH, steps=3, n_layer=LAYERS,
                    strategy_kwargs={"pipeline_parallel_size": 2, "microbatches": 2, **options}),
            tmp_path,
        )
        assert_same_training(reference, result, steps=3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (JobSpec(batch_size=6, strategy_kwargs={"microbatches": 4}), "The batch has 6 rows, which do not split into microbatches=4"),
        (
            JobSpec(n_layer=2, strategy_kwargs={"schedule": "interleaved_1f1b", "stages_per_rank": 2}),
            "The pipeline needs 4 stages but model.blocks has only 2 layers",
        ),
        (JobSpec(strategy_kwargs={"split_points": ["model.blocks.7"]}), "split_points ['model.blocks.7'] name no submodule of RecordingGPT"),
    ],
    ids=["batch-not-divisible", "more-stages-than-layers", "unknown-split-point"],
)
def test_bad_pipeline_input_fails_clearly(spec, message, tmp_path):
    spec.strategy, spec.devices, spec.steps = "pipeline", 2, 2
    spec.strategy_kwargs = {"pipeline_parallel_size": 2, "microbatches": 2, "timeout": 30, **spec.strategy_kwargs}
    proc = launch_worker(spec, tmp_path, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_untraceable_sequential_is_sliced_and_a_short_last_batch_stays_exact(tmp_path):
    """torch.export cannot trace the layers (data-dependent guard), so the nn.Sequential is sliced; 256
    samples in batches of 12 end the epoch with a 4-row batch, padded to the traced 12 rows."""
    steps = 22  # the whole epoch, the short batch last
    reference = run_job(JobSpec(model="regressor", batch_size=12, steps=steps))
    result = run_distributed(
        JobSpec(model="regressor", strategy="pipeline", devices=2, batch_size=12, steps=steps,
                strategy_kwargs={"pipeline_parallel_size": 2, "microbatches": 4}),
        tmp_path,
    )
    assert_same_training(reference, result, steps=steps)
    assert result["synced_logs"] == pytest.approx(reference["synced_logs"], abs=TOL)


def test_untraceable_module_that_is_not_sequential_fails_clearly(tmp_path):
    spec = JobSpec(model="regressor_loop", strategy="pipeline", devices=2, batch_size=8, steps=2,
                   strategy_kwargs={"pipeline_parallel_size": 2, "microbatches": 2, "timeout": 30})
    proc = launch_worker(spec, tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "Pipeline parallelism could not trace LayerLoop.forward with torch.export" in proc.stderr
    assert "keep the layers in an nn.Sequential" in proc.stderr
