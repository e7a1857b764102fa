"""Pipeline parallelism (pp2) on model families beyond the causal-LM matrix, against single-device training.

OPT and ViT hand a non-contiguous attention mask (an ``expand``) from one stage to the next, which gloo
refused to send; BERT has a submodule called ``self`` (``attention.self``), which the traced stage's
generated code assigned over ``self``; ResNet normalises with BatchNorm, whose statistics a pipeline of
several micro-batches would compute per micro-batch — refused, and exact with ``microbatches=1``. YOSO's
attention and a hand-written block call custom ``torch.autograd.Function``s whose backward is not their forward's
derivative: the traced stages keep it.
Every family has four blocks (two per stage); the transformers run more micro-batches than stages.
Models are built from tiny configs (``tests/hf_models.py``, ``OTHER_FAMILIES``), float64, dropout off.
"""

from __future__ import annotations

from functools import cache

import pytest

from tests.distributed.test_data_parallel import TOL, assert_same_training
from tests.harness import JobSpec, launch_worker, run_distributed_jobs, run_job
from tests.hf_models import is_image_family

pytestmark = pytest.mark.distributed

pytest.importorskip("transformers")

STEPS = 3
BATCH = 8
VAL_BATCH = 4  # token models validate with another batch size than training's
#: family -> pipeline options: four micro-batches on two stages, BatchNorm with one (the only exact way).
FAMILIES = {
    "opt": {"microbatches": 4},
    "bert": {"microbatches": 4},
    "vit": {"microbatches": 4},
    "resnet": {"microbatches": 1, "schedule": "gpipe"},
    "yoso:eager": {"microbatches": 4},  # YosoCumulation, a custom autograd.Function (YOSO has no SDPA path)
    "reduced_kv_attention": {"microbatches": 4},  # hand-written, with a custom autograd.Function in each block
}
#: FAMILIES that are written by hand (tests/hf_models.py), not built from a transformers config.
HAND_WRITTEN = ("reduced_kv_attention",)


def model_name(family: str) -> str:
    return family if family in HAND_WRITTEN else f"hf_{family}"


def val_batch(family: str) -> int | None:
    return None if is_image_family(family) else VAL_BATCH  # the image data module validates with the training batch


def job(family: str, options: dict) -> JobSpec:
    return JobSpec(
        model=model_name(family), strategy="pipeline", devices=2, batch_size=BATCH, val_batch_size=val_batch(family),
        steps=STEPS, validate=True,
        # Lightning's sanity check builds the pipeline from a validation batch; training traces its own shape.
        sanity_val_steps=1,
        strategy_kwargs={"timeout": 120, **options},
    )


@cache
def reference(family: str) -> dict:
    return run_job(JobSpec(model=model_name(family), batch_size=BATCH, val_batch_size=val_batch(family), steps=STEPS, validate=True))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every family's pp2 job, one after another in one 2-process launch."""
    specs = {family: job(family, options) for family, options in FAMILIES.items()}
    return run_distributed_jobs(specs, tmp_path_factory.mktemp("families"), timeout=600)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pipeline_matches_single_device(family, results):
    result, expected = results[family], reference(family)
    assert_same_training(expected, result, steps=STEPS)
    assert result["pipeline_training_rows"] == BATCH
    for key in expected["validation"]:
        assert result["validation"][key] == pytest.approx(expected["validation"][key], abs=TOL), key
    # Each rank holds its stage: well under the whole model.
    assert result["param_bytes"] < 0.8 * expected["param_bytes"]


def test_batchnorm_with_several_microbatches_is_refused(tmp_path):
    """ResNet's BatchNorm under microbatches=4 would normalise each micro-batch by its own statistics: the
    first training batch stops on every rank with the reason and the ways out, instead of training wrongly."""
    proc = launch_worker(job("resnet", {"microbatches": 4}), tmp_path, timeout=300)
    assert proc.returncode != 0
    message = "has BatchNorm layers (net.resnet.embedder.embedder.normalization"
    assert proc.stderr.count(message) >= 2, proc.stderr[-4000:]  # rank 0 and rank 1
    for fix in ("microbatches=1", "GroupNorm or LayerNorm", "sync_batchnorm=True"):
        assert fix in proc.stderr
