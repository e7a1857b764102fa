"""Context parallelism reproduces single-device training (float64): sequences split head-tail, ring attention.

Every job trains on the char corpus' 8-token blocks (cp2: four chunks of 2, cp4: eight chunks of 1), validates
with batches of another size, and compares losses, gradients and parameters after every optimizer step with
single-device training of the same global batch. The models cover the ways positions are built: the recipe
GPT (``pos_emb(torch.arange(L))``), a Llama-style module with rotary tables sliced ``cos[:L]`` and
``enable_gqa`` attention, a hand-written GQA module that repeats its key/value heads, and a tiny Mistral fed
packed documents (or padding) under a sliding window shorter than the block: masks transformers builds from the
whole sequence, run blockwise by the ring. The transformers
families under cp2 (``cache_position`` → ``position_ids`` → rotary or learned positions, SDPA with GQA) are in
``test_transformers.py``'s matrix, with Lightning's demo ``nn.Transformer`` refused there.
"""

from __future__ import annotations

from functools import cache

import pytest

from tests.distributed.test_data_parallel import assert_same_training
from tests.harness import JobSpec, run_distributed_jobs, run_job

pytestmark = pytest.mark.distributed

STEPS = 3
BATCH = 4  # per data-parallel replica
VAL_BATCH = 8

LOSS_PARALLEL_PLAN = {
    "model.blocks.*.attn.[qkv]_proj": "colwise", "model.blocks.*.attn.out_proj": "rowwise",
    "model.blocks.*.mlp.fc_in": "colwise", "model.blocks.*.mlp.fc_out": "rowwise", "model.lm_head": "loss_parallel",
}

#: name -> (ranks, model, data-parallel size, accumulation, strategy options)
JOBS: dict[str, tuple[int, str, int, int, dict]] = {
    "gpt-cp2-accumulate2": (2, "gpt", 1, 2, {"context_parallel_size": 2}),
    "rotary-cp2": (2, "rotary_attention", 1, 1, {"context_parallel_size": 2}),
    "gpt-cp4": (4, "gpt", 1, 1, {"context_parallel_size": 4}),
    "rotary-cp4-checkpointing": (4, "rotary_attention", 1, 1, {"context_parallel_size": 4, "activation_checkpointing": "auto"}),
    "gpt-dp2×cp2-accumulate2": (4, "gpt", 2, 2, {"context_parallel_size": 2, "data_parallel_size": 2}),
    "view-dp2×cp2-shard-round-trip": (4, "view_attention", 2, 1, {"context_parallel_size": 2, "data_parallel_size": 2, "data_parallel_mode": "shard"}),
    "rotary-tp2×cp2": (4, "rotary_attention", 1, 1, {"context_parallel_size": 2, "tensor_parallel_size": 2}),
    # Masks transformers builds from the whole sequence (tests/hf_models.py PackedDocumentsLM): packed documents
    # found from restarting position_ids under a sliding window of 3 (< the block of 8), and padding zeros in
    # attention_mask under the same window.
    "packed-window-cp2": (2, "packed_documents", 1, 1, {"context_parallel_size": 2}),
    "packed-window-cp2-accumulate2": (2, "packed_documents", 1, 2, {"context_parallel_size": 2}),
    "padded-window-cp2-accumulate2": (2, "padded_window", 1, 2, {"context_parallel_size": 2}),
    "packed-window-cp4": (4, "packed_documents", 1, 1, {"context_parallel_size": 4}),
    # A document of 6 tokens and one of 2 in every block: head-tail would leave rank 1 with 4x rank 0's attention
    # work, so the chunks are laid out by their work (4 chunks of 1 token per rank, balance.py).
    "packed-balanced-cp2-accumulate2": (2, "packed_long_first", 1, 2, {"context_parallel_size": 2}),
    # The recipe's data with pack_documents=true (documents between blank lines, position_ids restarting) and the
    # recipe GPT's document mask built in its forward from them, in blocks of 16.
    "recipe-packed-documents-cp2": (2, "gpt_packed", 1, 1, {"context_parallel_size": 2}),
    # An untied head split over the vocabulary (loss_parallel): its logits gathered over the sequence as DTensors.
    "gpt-tp2+sp×cp2": (4, "gpt", 1, 1, {"context_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True}),
    "gpt-tp2×cp2-loss-parallel-accumulate2": (4, "gpt", 1, 2, {"context_parallel_size": 2, "tensor_parallel_size": 2,
                                                               "plan": LOSS_PARALLEL_PLAN}),
}


#: The job whose ScalingMonitor's context-parallel traffic is checked byte for byte.
MONITORED = "gpt-cp4"
#: The job whose ScalingMonitor reports the balanced layout of packed documents.
BALANCED = "packed-balanced-cp2-accumulate2"


def job(name: str) -> JobSpec:
    devices, model, dp, accumulate, options = JOBS[name]
    if "data_parallel_size" not in options:
        options = {**options, "data_parallel_size": dp}
    return JobSpec(
        model=model, strategy="hybrid", devices=devices, batch_size=BATCH, val_batch_size=VAL_BATCH, accumulate=accumulate,
        steps=STEPS, validate=True, strategy_kwargs={"timeout": 120, **options}, monitor=name in (MONITORED, BALANCED),
        # Saved sharded (FSDP2 over dp_shard × cp), weights wiped, validated from the checkpoint.
        checkpoint_round_trip=name.endswith("round-trip"), tie_weights=_tied(name),
    )


def _tied(name: str) -> bool:
    return "loss-parallel" not in name  # a loss_parallel head is untied


@cache
def reference(model: str, dp: int, accumulate: int, tied: bool = True) -> dict:
    return run_job(JobSpec(model=model, batch_size=BATCH * dp * accumulate, val_batch_size=VAL_BATCH * dp, steps=STEPS,
                           validate=True, tie_weights=tied))


@cache
def launched(devices: int, tmp_root: str) -> dict[str, dict]:
    from pathlib import Path

    names = [name for name, (ranks, *_) in JOBS.items() if ranks == devices]
    return run_distributed_jobs({name: job(name) for name in names}, Path(tmp_root) / f"cp-{devices}", timeout=900)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("context-parallel"))


@pytest.mark.parametrize("name", list(JOBS))
def test_context_parallel_matches_single_device(name: str, tmp_root: str) -> None:
    devices, model, dp, accumulate, _ = JOBS[name]
    result = launched(devices, tmp_root)[name]
    expected = reference(model, dp, accumulate, _tied(name))
    assert_same_training(expected, result, steps=STEPS)
    # Validation (batches of 8, not 4): the whole-sequence loss and accuracy, as on one device.
    for key, value in expected["validation"].items():
        assert result["validation"][key] == pytest.approx(value, abs=1e-6), key
    if "sequence_parallel" in JOBS[name][4]:  # the norms ran on sequence shards: their parameters are DTensors
        assert "model.blocks.0.ln_1.weight" in result["dtensor_names"]
    if "plan" in JOBS[name][4]:  # the head split over the vocabulary
        assert result["local_numel"]["model.lm_head.weight"] <= expected["states"][0]["model.lm_head.weight"].numel() // 2
    # The step's logged loss is the whole sequence's (synced over dp only: cp peers hold the same value).
    if accumulate == 1 and expected["synced_logs"]:
        assert result["synced_logs"] == pytest.approx(expected["synced_logs"], abs=1e-6)


def test_monitor_counts_the_ring_and_the_output_gather_as_context_parallel_traffic(tmp_root: str) -> None:
    result = launched(JOBS[MONITORED][0], tmp_root)[MONITORED]
    cp, layers, heads, head_dim, vocab = 4, 2, 2, 8, 128  # the harness' GPT: 2 layers of width 16, 2 heads
    local = 8 // cp
    kv = 2 * BATCH * heads * local * head_dim * 8  # this rank's keys and values, float64
    # Per layer: forward and backward gather them, backward passes their gradients in cp exchanges; then the
    # logits are gathered once. Exactly what the planner's formula hands to collectives (plus the logits).
    expected = layers * (2 + cp) * kv + BATCH * local * vocab * 8
    for step in result["scaling_steps"]:
        assert step["cp_bytes"] == expected
        assert step["tp_bytes"] == 0
        assert 0 < step["cp_s"] < step["step_s"]
        # Ring attention's work on rank 0 (chunks 0 and 7 of 8, one token each): under the causal mask it computes
        # 8 blocks (its diagonal ones count half) and skips 7 of its 16, per layer, batch row and head.
        assert step["cp_scores_computed"] == layers * 8 * BATCH * heads
        assert step["cp_scores_skipped"] == layers * 7 * BATCH * heads
        assert step["cp_imbalance"] == 0.0  # no packed documents: head-tail, nothing to report


def test_monitor_reports_the_balanced_layout_of_packed_documents(tmp_root: str) -> None:
    result = launched(JOBS[BALANCED][0], tmp_root)[BALANCED]
    for step in result["scaling_steps"]:
        assert step["cp_imbalance"] == 1.0  # both ranks expect 10 blocks (head-tail: 2 and 8)
        assert step["cp_scores_skipped"] > 0 and step["cp_scores_computed"] > 0
