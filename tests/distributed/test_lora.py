"""LoRA fine-tuning (peft's ``get_peft_model`` on transformers Llama / Qwen2) under every layout, against one device.

Each job starts from base weights read with ``weights_from`` (a Hugging Face directory saved before wrapping: names
without ``base_layer``, no adapters), trains only the adapters (SGD with momentum over the trainable parameters) for
three steps, and must match one device training the same wrapped model from the same weights (float64: losses,
gradients and parameters after every step). Frozen base weights carry no gradient and no optimizer state anywhere,
DDP reduces only the adapters' bytes, tensor parallelism splits the base weights as the unwrapped model's (the
largest rank's share <= 0.6), and ``lightning_parallel.save_adapters`` writes peft's own format, which
``PeftModel.from_pretrained`` loads with the trained adapters. The 2-rank jobs run in
``test_deferred_init``'s launch (beside the other ``weights_from`` jobs), tp2 x pp2 in the shared 4-rank launch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import JobSpec

pytestmark = pytest.mark.distributed

STEPS = 3
#: Elements of the tiny wrapped Llama's adapters (rank 4, width 32, k/v 16, MLP 64): per block q 256, k 192, v 192,
#: o 256, gate 384, up 384, down 384; four blocks.
LLAMA_ADAPTER_NUMEL = 4 * (256 + 192 + 192 + 256 + 3 * 384)


def lora_jobs(weights: dict[str, str]) -> dict[str, tuple[JobSpec, dict]]:
    """The 2-rank LoRA jobs, name -> (job, arguments of test_deferred_init.reference)."""
    base, base_sharded = weights["llama_hf"], weights["llama_hf_sharded"]
    start = {"model": "lora_llama", "initial_weights": weights["lora_llama"]}
    return {
        "lora_llama_dp2": (JobSpec(model="lora_llama", strategy="data", devices=2, batch_size=2, steps=STEPS, empty_init=False,
                                   save_adapters=True, strategy_kwargs={"data_parallel_mode": "replicate", "weights_from": base}), start),
        "lora_llama_dp2_shard_accumulate2": (
            JobSpec(model="lora_llama", strategy="data", devices=2, batch_size=2, accumulate=2, steps=STEPS, empty_init=False,
                    strategy_kwargs={"data_parallel_mode": "shard", "weights_from": base_sharded}), {**start, "accumulate": 2}),
        "lora_llama_tp2_accumulate2": (
            JobSpec(model="lora_llama", strategy="tensor", devices=2, accumulate=2, steps=STEPS, empty_init=False, save_adapters=True,
                    strategy_kwargs={"data_parallel_mode": "replicate", "weights_from": base}), {**start, "accumulate": 2}),
        "lora_llama_pp2": (JobSpec(model="lora_llama", strategy="pipeline", devices=2, steps=STEPS, empty_init=False, save_adapters=True,
                                   strategy_kwargs={"microbatches": 4, "weights_from": base}), start),  # 4 micro-batches on 2 stages
    }


def save_lora_start(llama_state: dict[str, torch.Tensor], path: Path) -> None:
    """The whole wrapped model as a job starts: adapters as the job's seed draws them, base weights from
    ``llama_state`` (the unwrapped model's state dict), saved for the single-device reference."""
    from tests.harness import build

    model, *_ = build(JobSpec(model="lora_llama", empty_init=False))
    state = model.state_dict()
    for name in state:
        unwrapped = name.replace("net.base_model.model.", "net.", 1).replace(".base_layer.", ".")
        if "lora_" not in name:
            state[name] = llama_state[unwrapped].to(state[name].dtype)
    torch.save({"state_dict": state}, path)


def assert_only_adapters_train(name: str, result: dict) -> None:
    """No gradient and no optimizer state on frozen weights; DDP reduces the adapters' bytes only."""
    for step, grads in enumerate(result["grads"]):
        frozen = [n for n in grads if "lora_" not in n]
        assert not frozen, f"{name}: step {step}: frozen weights got gradients: {frozen[:3]}"
    trainable = {n for n, numel in result["local_numel"].items() if "lora_" in n}
    local = sum(numel for n, numel in result["local_numel"].items() if n in trainable)
    # SGD with momentum: one buffer per trainable tensor, none for the frozen ones (8 bytes per float64 element); the
    # gradients held before the step are the adapters' alone (under FSDP2 their shards: what was reduce-scattered).
    assert result["state_bytes"]["optimizer"] == 8 * local, (name, result["state_bytes"], local)
    assert result["state_bytes"]["gradients"] == 8 * local, (name, result["state_bytes"], local)
    if name == "lora_llama_dp2":
        assert result["comm"]["bytes"] == STEPS * 8 * LLAMA_ADAPTER_NUMEL, (name, result["comm"])


def assert_saved_adapters_load_in_peft(name: str, job_dir: Path, result: dict) -> None:
    """``PeftModel.from_pretrained`` loads what save_adapters wrote: the adapters as trained (last step's)."""
    from peft import PeftModel

    from tests.harness import make_model

    saved = job_dir / "adapters"
    assert (saved / "adapter_config.json").is_file() and (saved / "adapter_model.safetensors").is_file(), name
    plain = make_model(JobSpec(model="hf_llama")).net.double()
    loaded = PeftModel.from_pretrained(plain, str(saved))
    trained = {n.removeprefix("net."): t for n, t in result["states"][-1].items() if "lora_" in n}
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert sorted(got) == sorted(trained) and len(got) == 2 * 7 * 4, name
    for n, p in got.items():
        torch.testing.assert_close(p.detach(), trained[n], rtol=0, atol=1e-12, msg=f"{name}: {n}")


def four_rank_specs() -> dict[str, JobSpec]:
    """tp2 x pp2 (run in the suite's one 4-rank launch): base and adapters split inside each stage."""
    return {"lora_qwen2_tp2xpp2_accumulate2": JobSpec(
        model="lora_qwen2", strategy="hybrid", devices=4, accumulate=2, steps=STEPS, empty_init=False,
        strategy_kwargs={"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 4, "timeout": 120})}


def test_four_ranks_tp2_pp2(four_rank_launch):
    from tests.distributed.test_data_parallel import assert_same_training
    from tests.distributed.test_deferred_init import reference

    results, _, _ = four_rank_launch
    result = results["lora_qwen2_tp2xpp2_accumulate2"]
    assert_same_training(reference(model="lora_qwen2", accumulate=2), result, steps=STEPS)
    for step, grads in enumerate(result["grads"]):
        assert all("lora_" in n for n in grads), step
    # Inside the first stage: base weights and the adapters that follow them are DTensors on the tp mesh.
    split = set(result["dtensor_names"])
    attention = "net.base_model.model.model.layers.0.self_attn"
    assert {f"{attention}.q_proj.base_layer.weight", f"{attention}.q_proj.lora_B.default.weight",
            f"{attention}.o_proj.base_layer.weight", f"{attention}.o_proj.lora_A.default.weight"} <= split


def assert_lora_results(results: dict[str, dict], root: Path) -> None:
    """The 2-rank jobs' LoRA checks (their training was compared with one device by test_deferred_init)."""
    for name, result in results.items():
        if name.startswith("lora_"):
            assert_only_adapters_train(name, result)
    for name in ("lora_llama_dp2", "lora_llama_tp2_accumulate2", "lora_llama_pp2"):
        assert_saved_adapters_load_in_peft(name, root / name, results[name])
    # The frozen base weights split as the unwrapped model's: rank 0's share of the whole wrapped model.
    local = sum(results["lora_llama_tp2_accumulate2"]["local_numel"].values())
    assert local <= 0.6 * _whole_numel("llama"), local


def _whole_numel(family: str) -> int:
    from tests.harness import make_model

    return sum(p.numel() for p in make_model(JobSpec(model=f"lora_{family}")).parameters())
