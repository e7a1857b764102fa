"""TensorParallelStrategy reproduces single-device training of the recipe GPT (float64), with no module changes."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_data_parallel import TOL, assert_same_training
from tests.harness import JobSpec, run_distributed, run_job
from tests.planner_check import (
    assert_planner_predicts_communication,
    assert_planner_predicts_state,
)

pytestmark = pytest.mark.distributed

STEPS = 5


@pytest.mark.parametrize(
    ("accumulate", "clip"), [(1, None), (2, 0.05)], ids=["tp2", "tp2-accumulate2-gradient-clipping"]
)
def test_auto_plan_matches_single_device(accumulate, clip, tmp_path):
    # TP peers read the same batches: the global batch is the per-rank batch.
    reference = run_job(JobSpec(batch_size=4 * accumulate, steps=STEPS, validate=accumulate == 1, gradient_clip_val=clip))
    spec = JobSpec(
        strategy="tensor", devices=2, batch_size=4, accumulate=accumulate, steps=STEPS, validate=accumulate == 1,
        gradient_clip_val=clip, checkpoint_round_trip=accumulate == 1, monitor=True,
    )
    result = run_distributed(spec, tmp_path)
    assert_same_training(reference, result)
    # The planner's dry run on a fake process group predicts each rank's shards and DTensor's traffic.
    assert_planner_predicts_state(spec, result)
    assert_planner_predicts_communication(spec, result, ("tp",))
    # Split layers hold 1/TP of their weights per rank (row-wise biases stay whole), the tied embedding and head its
    # vocabulary rows; the rest stays whole.
    full_numel = {name: value.numel() for name, value in reference["grads"][0].items()}
    for name, local in result["local_numel"].items():
        split = any(f".{layer}." in name for layer in ("q_proj", "k_proj", "v_proj", "fc_in", "tok_emb")) or (
            name.endswith(("out_proj.weight", "fc_out.weight"))
        )
        assert local == (full_numel[name] // 2 if split else full_numel[name]), name
    # TP peers read the same batch.
    assert len(set(result["first_batch_checksums"])) == 1
    if accumulate == 1:
        assert result["synced_logs"] == pytest.approx(reference["synced_logs"], abs=TOL)
        # Validated after wiping the weights in memory: the numbers come from the saved checkpoint.
        for key in ("val/loss", "val/accuracy"):
            assert result["validation"][key] == pytest.approx(reference["validation"][key], abs=TOL), key
        assert_checkpoint_holds_whole_tensors(tmp_path / "final.ckpt", reference["states"][-1])


def assert_checkpoint_holds_whole_tensors(path, expected_state, n_layer=2):
    """A checkpoint written under TP (or PP) loads into the plain, unsplit module (read whole if sharded)."""
    from lightning_parallel import ParallelCheckpointIO
    from recipes.models.gpt import GPTLightningModule

    checkpoint = ParallelCheckpointIO().load_checkpoint(path)
    plain = GPTLightningModule(vocab_size=128, block_size=8, n_layer=n_layer, n_head=2, n_embd=16).double()
    plain.load_state_dict(checkpoint["state_dict"])  # strict: same keys, whole shapes
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, expected_state[name], rtol=0, atol=TOL)
    optimizer_state = checkpoint["optimizer_states"][0]["state"]
    assert optimizer_state and all(
        type(t) is torch.Tensor for entry in optimizer_state.values() for t in entry.values() if isinstance(t, torch.Tensor)
    )


def test_explicit_plan_by_pattern(tmp_path):
    # MLPs by pattern, and the (untied) position embedding split over its rows.
    plan = {"model.blocks.*.mlp.fc_in": "colwise", "model.blocks.*.mlp.fc_out": "rowwise", "model.pos_emb": "vocab_parallel"}
    reference = run_job(JobSpec(batch_size=4, steps=3))
    result = run_distributed(JobSpec(strategy="tensor", devices=2, batch_size=4, steps=3, strategy_kwargs={"plan": plan}), tmp_path)
    assert_same_training(reference, result, steps=3)
    assert result["local_numel"]["model.pos_emb.weight"] == reference["states"][0]["model.pos_emb.weight"].numel() // 2


def test_data_parallel_replicas_of_a_tensor_parallel_group(tmp_path):
    """dp=2 × tp=2 on 4 ranks (FSDP2 over dp), accumulation and clipping: one device with the 2·2× batch."""
    reference = run_job(JobSpec(batch_size=4 * 2 * 2, steps=STEPS, gradient_clip_val=0.05))
    result = run_distributed(
        JobSpec(strategy="tensor", devices=4, batch_size=4, accumulate=2, steps=STEPS, gradient_clip_val=0.05,
                checkpoint_round_trip=True, perturb_other_ranks=True, strategy_kwargs={"tensor_parallel_size": 2}),
        tmp_path,
    )
    assert result["world_size"] == 4
    assert_same_training(reference, result)
    # One gradient reduce-scatter per FSDP unit (2 blocks + the rest of the model) per optimizer step:
    # the accumulating micro-batches skip it.
    assert result["reduce_scatters"] == 3 * STEPS
    # Ranks 0,1 form one TP group and 2,3 the other: peers share batches, replicas do not.
    first, _, third, _ = result["first_batch_checksums"]
    assert result["first_batch_checksums"] == [first, first, third, third] and first != third
    assert_checkpoint_holds_whole_tensors(tmp_path / "final.ckpt", reference["states"][-1])


@pytest.mark.parametrize("devices", [2, 4], ids=["tp2-sequence-parallel", "dp2-tp2-sequence-parallel"])
def test_sequence_parallel_matches_single_device(devices, tmp_path):
    replicas = devices // 2
    reference = run_job(JobSpec(batch_size=4 * replicas, steps=STEPS))
    result = run_distributed(
        JobSpec(strategy="tensor", devices=devices, batch_size=4, steps=STEPS,
                strategy_kwargs={"tensor_parallel_size": 2, "sequence_parallel": True}),
        tmp_path,
    )
    assert_same_training(reference, result)
    if devices == 2:
        # The norms now run on sequence shards: their parameters became (replicated) DTensors.
        assert "model.blocks.0.ln_1.weight" in result["dtensor_names"]
        assert "model.ln_f.weight" not in result["dtensor_names"]  # outside the trunk: unchanged


@pytest.mark.parametrize("accumulate", [1, 2], ids=["tp2", "tp2-accumulate2"])
def test_loss_parallel_head_matches_single_device(accumulate, tmp_path):
    """An untied head split over the vocabulary; cross-entropy on the shards; whole logits in validation.

    With accumulation every micro-batch (Lightning runs all but the last inside ``block_backward_sync``)
    must still compute the loss on the shards.
    """
    plan = {
        "model.blocks.*.attn.[qkv]_proj": "colwise", "model.blocks.*.attn.out_proj": "rowwise",
        "model.blocks.*.mlp.fc_in": "colwise", "model.blocks.*.mlp.fc_out": "rowwise",
        "model.lm_head": "loss_parallel",
    }
    validate = accumulate == 1
    reference = run_job(JobSpec(batch_size=4 * accumulate, steps=STEPS, validate=validate, tie_weights=False))
    result = run_distributed(
        JobSpec(strategy="tensor", devices=2, batch_size=4, accumulate=accumulate, steps=STEPS, validate=validate,
                tie_weights=False, strategy_kwargs={"plan": plan}),
        tmp_path,
    )
    assert_same_training(reference, result)
    assert result["local_numel"]["model.lm_head.weight"] == reference["states"][0]["model.lm_head.weight"].numel() // 2
    if not validate:
        return
    # The loss logged with sync_dist and torchmetrics on the (whole, in eval) logits agree too.
    assert result["synced_logs"] == pytest.approx(reference["synced_logs"], abs=TOL)
    for key in ("val/loss", "val/accuracy"):
        assert result["validation"][key] == pytest.approx(reference["validation"][key], abs=TOL), key
