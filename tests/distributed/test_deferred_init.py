"""Models bigger than one device: built on the meta device, set up per rank, pretrained weights read into shards.

Every job builds its model under ``trainer.init_module(empty_init=True)`` (unless it says eager) and must
train exactly like the same model built eagerly on one device (float64, losses, gradients and parameters
after every step); with ``weights_from`` like the whole module with those weights loaded. The 8-rank
dp2 × tp2 × pp2 case is ``test_hybrid_parallel.test_dp2_tp2_pp2_1f1b_with_accumulation_and_clipping``.
The memory each rank adds during setup is measured in fresh processes (``benchmarks/setup_memory.py``).
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.distributed.moe_export import assert_exports, export_jobs
from tests.distributed.test_data_parallel import assert_same_training
from tests.harness import JobSpec, make_model, run_distributed_jobs, run_job

pytestmark = pytest.mark.distributed

STEPS = 3


@pytest.fixture(scope="module")
def saved_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Weights of a recipe GPT and a transformers Llama in every format ``weights_from`` reads (float32,
    drawn from another seed than the jobs', so that loading them shows)."""
    pytest.importorskip("transformers")
    from lightning_parallel.checkpoint.sharded import write_whole

    folder = tmp_path_factory.mktemp("weights")
    L.seed_everything(7)
    gpt = make_model(JobSpec())
    gpt_state = {k: v.detach().clone() for k, v in gpt.state_dict().items()}
    torch.save({"state_dict": gpt_state}, folder / "gpt.ckpt")
    write_whole({"state_dict": gpt_state}, folder / "gpt_sharded.ckpt")
    llama = make_model(JobSpec(model="hf_llama"))
    torch.save({"state_dict": llama.state_dict()}, folder / "llama.ckpt")
    llama.net.save_pretrained(folder / "llama_hf_sharded", max_shard_size="20KB")  # several files + index
    llama.net.save_pretrained(folder / "llama_hf")  # one model.safetensors
    # transformers saves a Mixtral's fused experts one module per expert, under the Hub's names (block_sparse_moe).
    mixtral = make_model(JobSpec(model="hf_mixtral"))
    torch.save({"state_dict": mixtral.state_dict()}, folder / "mixtral.ckpt")
    mixtral.net.save_pretrained(folder / "mixtral_hf")
    assert (folder / "llama_hf_sharded" / "model.safetensors.index.json").is_file()
    if importlib.util.find_spec("peft") is not None:  # LoRA jobs (test_lora): the wrapped model starting from llama's
        from tests.distributed.test_lora import save_lora_start

        save_lora_start(llama.state_dict(), folder / "lora_llama.ckpt")
    return {p.name.removesuffix(".ckpt"): p for p in folder.iterdir()}


@cache
def reference(model: str = "gpt", batch_size: int = 4, accumulate: int = 1, initial_weights: str | None = None,
              val_batch_size: int | None = None) -> dict:
    """One device, the model built eagerly (in float64, as the deferred jobs build theirs); validated when
    ``val_batch_size`` is given."""
    return run_job(JobSpec(model=model, batch_size=batch_size * accumulate, steps=STEPS, empty_init=False, initial_weights=initial_weights,
                           validate=val_batch_size is not None, val_batch_size=val_batch_size))


def test_meta_init_and_weights_from_on_two_ranks(saved_weights, tmp_path):
    w = {name: str(path) for name, path in saved_weights.items()}
    replicate = {"data_parallel_mode": "replicate"}
    shard = {"data_parallel_mode": "shard"}
    # name -> (job, reference arguments)
    jobs: dict[str, tuple[JobSpec, dict]] = {
        "tp2": (JobSpec(strategy="tensor", devices=2, steps=STEPS, empty_init=True, strategy_kwargs=replicate), {}),
        "pp2_accumulate2": (
            JobSpec(strategy="pipeline", devices=2, steps=STEPS, accumulate=2, empty_init=True, strategy_kwargs={"microbatches": 2}),
            {"accumulate": 2},
        ),
        "dp2_shard": (JobSpec(strategy="data", devices=2, batch_size=2, steps=STEPS, empty_init=True, strategy_kwargs=shard), {}),
        "llama_tp2": (JobSpec(model="hf_llama", strategy="tensor", devices=2, steps=STEPS, empty_init=True, strategy_kwargs=replicate),
                      {"model": "hf_llama"}),
        "tp2_from_full_file": (
            JobSpec(strategy="tensor", devices=2, steps=STEPS, empty_init=True, strategy_kwargs={**replicate, "weights_from": w["gpt"]}),
            {"initial_weights": w["gpt"]},
        ),
        "pp2_from_sharded_checkpoint": (
            JobSpec(strategy="pipeline", devices=2, steps=STEPS, empty_init=True, strategy_kwargs={"weights_from": w["gpt_sharded"]}),
            {"initial_weights": w["gpt"]},
        ),
        "dp2_shard_eager_from_full_file": (
            JobSpec(strategy="data", devices=2, batch_size=2, steps=STEPS, strategy_kwargs={**shard, "weights_from": w["gpt"]}),
            {"initial_weights": w["gpt"]},
        ),
        "llama_tp2_from_sharded_safetensors": (
            JobSpec(model="hf_llama", strategy="tensor", devices=2, steps=STEPS, empty_init=True,
                    strategy_kwargs={**replicate, "weights_from": w["llama_hf_sharded"]}),
            {"model": "hf_llama", "initial_weights": w["llama"]},
        ),
        "llama_pp2_from_safetensors": (
            JobSpec(model="hf_llama", strategy="pipeline", devices=2, steps=STEPS, empty_init=True,
                    strategy_kwargs={"weights_from": w["llama_hf"], "microbatches": 2}),
            {"model": "hf_llama", "initial_weights": w["llama"]},
        ),
        "llama_dp2_shard_from_safetensors": (
            JobSpec(model="hf_llama", strategy="data", devices=2, batch_size=2, steps=STEPS, empty_init=True,
                    strategy_kwargs={**shard, "weights_from": w["llama_hf_sharded"]}),
            {"model": "hf_llama", "initial_weights": w["llama"]},
        ),
        # Meta's hand-written RMSNorm (torch.ones in __init__, no reset_parameters()): its creation is replayed,
        # a replicated weight under tp2, a DTensor shard filled in place under FSDP2, a stage's under pp2.
        "hand_norm_tp2": (JobSpec(model="hand_norm_attention", strategy="tensor", devices=2, steps=STEPS, empty_init=True,
                                  strategy_kwargs=replicate), {"model": "hand_norm_attention"}),
        "hand_norm_dp2_shard": (JobSpec(model="hand_norm_attention", strategy="data", devices=2, batch_size=2, steps=STEPS,
                                        empty_init=True, strategy_kwargs=shard), {"model": "hand_norm_attention"}),
        "hand_norm_pp2": (JobSpec(model="hand_norm_attention", strategy="pipeline", devices=2, steps=STEPS, empty_init=True,
                                  strategy_kwargs={"microbatches": 2}), {"model": "hand_norm_attention"}),
        # A Mixture-of-Experts model built on meta, its experts divided over ep=2 (each rank materialises its half).
        "moe_dp2_ep2": (JobSpec(model="gpt_moe", strategy="hybrid", devices=2, batch_size=2, steps=STEPS, empty_init=True,
                                strategy_kwargs={"data_parallel_size": 2, "expert_parallel_size": 2}), {"model": "gpt_moe"}),
        # ... loading a Hugging Face directory whose experts are stored one module each: each rank reads its own.
        "mixtral_dp2_ep2_from_per_expert_safetensors": (
            JobSpec(model="hf_mixtral", strategy="hybrid", devices=2, batch_size=2, steps=STEPS, empty_init=True,
                    strategy_kwargs={"data_parallel_size": 2, "expert_parallel_size": 2, "weights_from": w["mixtral_hf"]}),
            {"model": "hf_mixtral", "initial_weights": w["mixtral"]},
        ),
        # Built on meta and first cut by Lightning's sanity check (validation batches of 8), then trained on 4.
        "llama_pp2_first_batch_a_validation_one": (
            JobSpec(model="hf_llama", strategy="pipeline", devices=2, steps=STEPS, empty_init=True, validate=True, val_batch_size=8,
                    sanity_val_steps=1, strategy_kwargs={"microbatches": 2}),
            {"model": "hf_llama", "val_batch_size": 8},
        ),
    }
    # Drawn into each rank's shards (init_values: draw_into_shards): eager's distribution, not its values, so it is
    # checked against the reference's first loss below rather than step by step.
    drawn = {"llama_tp2_draw_into_shards": JobSpec(model="hf_llama", strategy="tensor", devices=2, steps=STEPS, empty_init=True,
                                                   strategy_kwargs={**replicate, "init_values": "draw_into_shards"})}
    if "lora_llama" in w:  # peft installed: LoRA under dp2, dp2 shard, tp2, pp2 (tests/distributed/test_lora.py)
        from tests.distributed.test_lora import lora_jobs

        jobs.update(lora_jobs(w))
    jobs.update(export_jobs())  # MoE checkpoints saved under dp2 ep2 and tp2, exported below (moe_export.py)
    results = run_distributed_jobs({**{name: job for name, (job, _) in jobs.items()}, **drawn}, tmp_path, timeout=600)
    first = reference(model="hf_llama")["step_losses"]
    losses = results["llama_tp2_draw_into_shards"]["step_losses"]
    assert torch.isfinite(losses).all() and not torch.equal(losses, first)
    assert float(losses[0]) == pytest.approx(float(first[0]), rel=0.05)  # both a fresh model's loss: about ln(vocabulary)
    for name, (job, reference_arguments) in jobs.items():
        try:
            assert_same_training(reference(**reference_arguments), results[name], steps=STEPS)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
    if "lora_llama" in w:
        from tests.distributed.test_lora import assert_lora_results

        assert_lora_results(results, tmp_path)
    assert_exports(results, tmp_path)
    validated, expected = results["llama_pp2_first_batch_a_validation_one"], reference(model="hf_llama", val_batch_size=8)
    assert validated["pipeline_training_rows"] == 4
    for key in ("val/loss", "val/accuracy"):
        assert validated["validation"][key] == pytest.approx(expected["validation"][key], abs=1e-6), key
    # The loaded weights are not the ones the seed draws: loading them was not a no-op.
    assert not torch.equal(reference()["step_losses"], reference(initial_weights=w["gpt"])["step_losses"])
    # Under tp2 each rank holds half of every split layer (the memory claim is measured below).
    numel = results["tp2"]["local_numel"]
    assert numel["model.blocks.0.mlp.fc_in.weight"] * 2 == 4 * 16 * 16
    # Under ep2 each rank holds half of the experts (2 of 4, each 4·16 × 16).
    assert results["moe_dp2_ep2"]["local_numel"]["model.blocks.0.mlp.experts.up_proj"] == 2 * 4 * 16 * 16


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2_shard"])
def test_setup_adds_at_most_six_tenths_of_the_model_per_rank(layout, tmp_path):
    """Peak resident memory a rank adds from building the model to training (a 1.3 GB model, fresh processes)."""
    from benchmarks.setup_memory import MODEL, run_variant

    result = run_variant(layout, 2, True, MODEL, tmp_path / layout)
    assert result["max_fraction"] <= 0.6, f"{layout}: ranks added {result['fractions']} of the whole model during setup"
