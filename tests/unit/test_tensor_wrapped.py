"""Projections wrapped with peft's LoRA adapters under the automatic tensor-parallel plan (tensor.wrapped), on 2
simulated ranks: the base weights split as the unwrapped model's, the adapters with them, exact against one device."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig
from lightning_parallel.parallelize.tensor.wrapped import find_wrapped
from tests.unit.tp_simulated import split_and_run, whole_run

pytest.importorskip("peft")
pytest.importorskip("transformers")


class Logits(nn.Module):
    """A peft-wrapped tiny causal LM returning its logits (float64)."""

    def __init__(self, family: str) -> None:
        super().__init__()
        import transformers
        from peft import get_peft_model

        from tests.hf_models import build_config
        from tests.lora_models import lora_config

        torch.manual_seed(0)
        config = build_config(family)
        config.num_hidden_layers = 1  # one block holds every case; the 2-rank launch trains four
        self.net = get_peft_model(transformers.AutoModelForCausalLM.from_config(config).double(), lora_config())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=x).logits


def test_lora_model_splits_like_the_unwrapped_one_and_stays_exact(simulated_ranks):
    from torch.distributed.tensor import DTensor

    module = Logits("llama")
    plain = copy.deepcopy(module.net).get_base_model()
    x = torch.randint(0, 50, (2, 8))
    expected_out, expected_grads = whole_run(copy.deepcopy(module), x)
    out, grads, resolved = split_and_run(module, simulated_ranks, x, reduce_regions=True, warn=lambda _: None)
    # The plan names the projections as the unwrapped model's plan does (same styles), the wrappers beside it.
    unwrapped = TensorParallelConfig().resolve(plain, tp_size=2, warn=lambda _: None).styles
    prefix = "net.base_model.model."
    assert {fqn.removeprefix(prefix): style for fqn, style in resolved.styles.items()} == unwrapped
    assert len(resolved.wrapped) == 7
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    assert sorted(grads) == sorted(expected_grads)  # frozen weights get no gradient, split or not
    assert all("lora_" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=0, atol=1e-12, msg=name)
    attention = f"{prefix}model.layers.0.self_attn"
    placements = {name: p.placements[0] for name, p in module.named_parameters() if isinstance(p, DTensor)}
    # Column-wise base: lora_B split over its outputs, lora_A whole; row-wise base: lora_A split over its inputs.
    assert placements[f"{attention}.q_proj.base_layer.weight"].is_shard(0)
    assert placements[f"{attention}.q_proj.lora_B.default.weight"].is_shard(0)
    assert f"{attention}.q_proj.lora_A.default.weight" not in placements
    assert placements[f"{attention}.o_proj.base_layer.weight"].is_shard(1)
    assert placements[f"{attention}.o_proj.lora_A.default.weight"].is_shard(1)
    assert f"{attention}.o_proj.lora_B.default.weight" not in placements
    assert not any(p.requires_grad for name, p in module.named_parameters() if "base_layer" in name)
    local = sum((p._local_tensor._local_tensors[0] if isinstance(p, DTensor) else p).numel() for p in module.parameters())
    assert local <= 0.6 * sum(p.numel() for p in module.parameters())  # as the unwrapped model's tp2 share


class Dora(nn.Module):
    """A wrapper holding a parameter outside its adapter pairs (DoRA's magnitude): not followed, left whole."""

    def __init__(self) -> None:
        super().__init__()
        self.base_layer = nn.Linear(8, 8)
        self.lora_A, self.lora_B = nn.ModuleDict({"a": nn.Linear(8, 2)}), nn.ModuleDict({"a": nn.Linear(2, 8)})
        self.magnitude = nn.Parameter(torch.ones(8))


def test_a_wrapper_holding_more_than_adapter_pairs_is_left_whole_and_named():
    warnings: list[str] = []
    module = nn.Sequential(Dora())
    assert find_wrapped(module, warnings.append) == {}
    assert warnings and "0: Dora wraps a projection with parameters" in warnings[0] and "left whole" in warnings[0]
    plain = nn.Sequential(nn.Module())
    plain[0].base_layer = nn.Linear(8, 8)
    plain[0].lora_A, plain[0].lora_B = nn.ModuleDict({"a": nn.Linear(8, 2)}), nn.ModuleDict({"a": nn.Linear(2, 8)})
    (found,) = find_wrapped(plain).values()
    assert found.adapters == {"a": ("lora_A.a", "lora_B.a")}


def test_adapter_dropout_beside_a_column_split_draws_one_mask_on_every_rank():
    """Two ranks' copies (same shared seed, same module name) drop the same elements, call after call, scaled by
    1/(1-p); another module's mask differs; evaluation passes the input through."""
    from lightning_parallel.parallelize.tensor.wrapped import SameMaskDropout

    x = torch.ones(64, 32, dtype=torch.float64)
    rank0, rank1 = (SameMaskDropout(0.25, seed=11, name="layers.0.q_proj") for _ in range(2))
    other = SameMaskDropout(0.25, seed=11, name="layers.0.k_proj")
    for _ in range(2):
        a, b = rank0(x), rank1(x)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert set(a.unique().tolist()) == {0.0, 1 / 0.75}
        assert 0.15 < (a == 0).double().mean() < 0.35
    assert not torch.equal(other(x), rank0(x))
    rank0.eval()
    assert rank0(x) is x
