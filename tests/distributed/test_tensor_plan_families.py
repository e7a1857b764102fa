"""The automatic tensor-parallel plan on families whose layout the plain Llama-style matcher missed (float64, tp2).

One launch of 2 ranks: BERT (attention and MLP split across sibling modules), Falcon (multi-query fused
``query_key_value``: its query heads split, its one key/value head gathered whole after the projection; the MLP of
``FalconLinear`` layers is split; the output of a row-wise layer is added to in place), Falcon's new decoder architecture (``query_key_value`` grouped per k/v
head), BLOOM (ALiBi slopes per head, cut to each rank's heads), LitGPT (fused GQA ``qkv`` whose head
counts live on its ``Config`` dataclass) and a hand-written attention whose keys and values read a SegFormer-style
sequence reduction (:class:`tests.hf_models.ReducedKVAttention`), Mamba and Mamba-2 (state-space mixers split over
their channels and heads); Falcon also with sequence parallelism. Each trains as on one device, and each rank holds at most the
share of the parameters given below (the largest rank's parameters / the whole model's).
"""

from __future__ import annotations

import pytest

from tests.distributed.test_data_parallel import TOL, assert_same_training
from tests.harness import JobSpec, run_distributed_jobs, run_job

pytestmark = pytest.mark.distributed
pytest.importorskip("transformers")

STEPS = 3
#: job name -> (model, the largest share of the parameters one rank may hold[, strategy options]).
FAMILIES = {
    "bert": ("hf_bert", 0.6),
    # Its one k/v head cannot be divided by heads: the queries split, the k/v head's features split and gathered.
    "falcon": ("hf_falcon", 0.6),
    # ... and with sequence parallelism (the split attention gathers the sequence like every other).
    "falcon_sequence_parallel": ("hf_falcon", 0.6, {"sequence_parallel": True}),
    "falcon_grouped": ("hf_falcon_grouped", 0.6),
    "bloom": ("hf_bloom:eager", 0.6),  # BLOOM has no SDPA path in transformers
    "litgpt": ("litgpt", 0.6),
    # Hand-written: keys and values from a sequence reduction of the attention's input (run whole on every rank, its
    # gradient whole), a per-token gate multiplied into this rank's heads (its gradient a partial sum, reduced).
    "reduced_kv": ("reduced_kv_attention", 0.65),
    # State-space mixers split over their inner channels (Mamba-1) and heads (Mamba-2, its one group of B/C gathered).
    "mamba": ("hf_mamba:eager", 0.6),  # no attention: transformers refuses the default sdpa
    "mamba2": ("hf_mamba2:eager", 0.6),
}


def spec(model: str, strategy: str, devices: int, options: dict | None = None) -> JobSpec:
    return JobSpec(model=model, strategy=strategy, devices=devices, batch_size=4, val_batch_size=2, steps=STEPS, validate=True,
                   strategy_kwargs=options or {})


def test_auto_plan_splits_each_family_and_matches_single_device(tmp_path):
    pytest.importorskip("litgpt")
    results = run_distributed_jobs({name: spec(model, "tensor", 2, *options) for name, (model, _, *options) in FAMILIES.items()},
                                   tmp_path)
    for name, (model, largest_share, *_) in FAMILIES.items():
        reference = run_job(spec(model, "single", 1))
        result = results[name]
        assert_same_training(reference, result, steps=STEPS)
        assert result["validation"]["val/loss"] == pytest.approx(reference["validation"]["val/loss"], abs=TOL), name
        whole = sum(grad.numel() for grad in reference["grads"][0].values())
        share = sum(result["local_numel"].values()) / whole
        assert share <= largest_share, f"{name}: rank 0 holds {share:.2f} of the parameters"
