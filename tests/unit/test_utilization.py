"""MFU and tokens/s: the model FLOPs against a hand count, the dtype's peak, impossible values refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_parallel.observe.utilization import (
    check_mfu,
    model_flops_per_sample,
    tokens_in,
    training_dtype,
    utilization,
)
from lightning_parallel.plan.hardware import HardwareProfile
from lightning_parallel.plan.profile import profile_model
from recipes.models.gpt import GPTLightningModule

H100 = HardwareProfile(
    name="h100", device_memory_gib=80, peak_tflops=989, achievable_fraction=0.4, devices_per_node=8,
    intra_node_gbps=450, inter_node_gbps=50, peak_dtype="bf16", peak_tflops_by_dtype={"fp32": 67},
)


def test_model_flops_of_the_recipe_gpt_are_the_hand_count():
    """6 · (matmul parameters) · tokens + the attention scores and values (2 · 2 · T · d per token and
    layer, forward), times 3 for forward + backward (recomputation under checkpointing is never added)."""
    d, layers, T, vocab = 32, 2, 16, 128
    config = {"vocab_size": vocab, "block_size": T, "n_layer": layers, "n_head": 2, "n_embd": d, "dropout": 0.0, "lr": 1e-3}
    tokens = torch.randint(0, vocab, (4, T))
    profile = profile_model(lambda: GPTLightningModule(**config), (tokens, tokens))
    matmul_parameters = layers * (4 * d * d + 2 * 4 * d * d) + vocab * d  # q, k, v, out; fc_in, fc_out; head
    per_token = 6 * matmul_parameters + 3 * 2 * 2 * T * d * layers
    assert model_flops_per_sample(profile) == per_token * T


def test_mfu_divides_by_the_training_dtypes_peak():
    used = utilization(1e12, samples=8, tokens=8 * 1024, step_s=0.5, devices=8, hardware=H100, dtype="bf16", processes_on_node=8)
    assert used.mfu == pytest.approx(8e12 / 0.5 / (8 * 989e12))
    assert used.tokens_per_s == 8 * 1024 / 0.5 and used.tokens_per_s_per_device == 1024 / 0.5
    fp32 = utilization(1e12, samples=8, tokens=8, step_s=0.5, devices=8, hardware=H100, dtype="fp32", processes_on_node=8)
    assert fp32.mfu == pytest.approx(used.mfu * 989 / 67)
    with pytest.raises(ValueError, match=r"gives a peak for \['bf16', 'fp32'\] but training runs in fp16.*peak_tflops_by_dtype.fp16"):
        utilization(1e12, samples=8, tokens=8, step_s=0.5, devices=8, hardware=H100, dtype="fp16", processes_on_node=8)


def test_shared_cores_share_the_peak_and_a_measured_peak_is_measured():
    cpu = replace(H100, name="cpu", peak_tflops=0.07, node_tflops=0.12, peak_dtype="fp32", peak_tflops_by_dtype=None)
    assert cpu.peak_flops("fp32", processes_on_node=1) == pytest.approx(0.07e12)
    assert cpu.peak_flops("fp32", processes_on_node=4) == pytest.approx(0.03e12)
    measured = replace(cpu, measured_peak=True)
    peak = measured.peak_flops("fp64", processes_on_node=1)
    assert 1e8 < peak < 1e13  # a real matmul rate of this machine, in FLOP/s


def test_impossible_mfu_is_refused():
    check_mfu(0.99, "step 3")
    with pytest.raises(RuntimeError, match="step 3: MFU 1.20 > 1 is impossible.*counted twice.*another dtype"):
        check_mfu(1.2, "step 3")


def test_precisions_and_tokens():
    assert [training_dtype(p) for p in ("bf16-mixed", "16-mixed", "32-true", "64-true")] == ["bf16", "fp16", "fp32", "fp64"]
    with pytest.raises(ValueError, match="precision='transformer-engine' has no known compute dtype"):
        training_dtype("transformer-engine")
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert tokens_in((ids, ids)) == 64
    assert tokens_in({"input_ids": ids}) == 64
    assert tokens_in((torch.zeros(4, 3), torch.zeros(4))) == 4  # not a sequence: a sample is one token


def test_model_flops_of_a_mixture_of_experts_count_k_experts_per_token():
    """The meta dry run cannot follow a router's data-dependent choices: routed experts are counted at even load,
    k experts' MLPs per token (here k=2 of 4: twice the dense MLP's matmuls), plus the router."""
    d, layers, T, vocab, experts, k = 32, 2, 16, 128, 4, 2
    config = {"vocab_size": vocab, "block_size": T, "n_layer": layers, "n_head": 2, "n_embd": d, "dropout": 0.0, "lr": 1e-3}
    tokens = torch.randint(0, vocab, (4, T))
    dense = profile_model(lambda: GPTLightningModule(**config), (tokens, tokens))
    moe = profile_model(lambda: GPTLightningModule(**config, n_experts=experts, experts_per_token=k), (tokens, tokens))
    mlp = 2 * 4 * d * d  # fc_in + fc_out, one expert's up + down
    router = d * experts
    assert model_flops_per_sample(moe) - model_flops_per_sample(dense) == 6 * layers * ((k - 1) * mlp + router) * T
