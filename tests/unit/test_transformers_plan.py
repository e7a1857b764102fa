"""Plans inferred for Hugging Face models (built from tiny configs, nothing downloaded), and fused layouts."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.parallelize.fused import FusedLayout
from lightning_parallel.parallelize.tensor import TensorParallelConfig, check_plan

pytest.importorskip("transformers")

from tests.hf_models import HFCausalLM


def plan_of(family: str):
    return TensorParallelConfig().resolve(HFCausalLM(family), warn=lambda _: None)


def test_llama_plan_uses_its_published_entries_for_embedding_and_head():
    resolved = plan_of("llama")
    assert resolved.styles["net.model.layers.0.self_attn.q_proj"] == "colwise"
    assert resolved.styles["net.model.layers.0.self_attn.o_proj"] == "rowwise"
    assert resolved.styles["net.model.layers.0.mlp.down_proj"] == "rowwise"
    assert resolved.sources["net.model.layers.0.self_attn.q_proj"] == "inferred"
    assert resolved.styles["net.model.embed_tokens"] == "embedding_rowwise"
    assert resolved.styles["net.lm_head"] == "colwise_gather_output"
    assert resolved.sources["net.lm_head"] == "model's tp_plan"
    # GQA: both head counts live on the (copied) config and shrink with the split.
    assert resolved.head_attributes["net.model.layers.0.self_attn"] == ("config.num_attention_heads", "config.num_key_value_heads")
    assert "(model's tp_plan)" in resolved.describe()


def test_fused_projections_are_split_by_blocks():
    phi3 = plan_of("phi3")
    # 4 query heads and 2 key/value heads of width 8: q | k | v = 32 | 16 | 16.
    assert phi3.styles["net.model.layers.0.self_attn.qkv_proj"] == "fused_qkv"
    assert phi3.fused["net.model.layers.0.self_attn.qkv_proj"] == (32, 16, 16)
    assert phi3.fused["net.model.layers.0.mlp.gate_up_proj"] == (64, 64)
    gpt2 = plan_of("gpt2")
    assert gpt2.styles["net.transformer.h.0.attn.c_attn"] == "fused_qkv"
    assert gpt2.fused["net.transformer.h.0.attn.c_attn"] == (32, 32, 32)
    assert "net.transformer.h.0.attn.c_attn" in gpt2.conv1d
    assert gpt2.styles["net.transformer.h.0.mlp.c_fc"] == "colwise"  # Conv1D MLP recognised by shape
    assert "net.lm_head" not in gpt2.styles  # tied to the embedding: kept whole
    # GPT-NeoX interleaves q, k, v per head: the published plain column split is whole heads.
    neox = plan_of("gpt_neox")
    assert neox.styles["net.gpt_neox.layers.0.attention.query_key_value"] == "colwise"
    assert "config.num_attention_heads" in neox.head_attributes["net.gpt_neox.layers.0.attention"]


def test_head_counts_that_do_not_divide_are_refused():
    model = HFCausalLM("llama")
    resolved = TensorParallelConfig().resolve(model, warn=lambda _: None)
    check_plan(model, resolved, 2)
    # 2 key/value heads cannot be split 4 ways.
    with pytest.raises(ValueError, match=r"self_attn\.config\.num_key_value_heads=2 is not divisible by tensor_parallel_size=4"):
        check_plan(model, resolved, 4)
    phi3 = HFCausalLM("phi3")
    with pytest.raises(ValueError, match=r"qkv_proj\.k block=16 is not divisible by tensor_parallel_size=32"):
        check_plan(phi3, TensorParallelConfig().resolve(phi3, warn=lambda _: None), 32)


@pytest.mark.parametrize(("blocks", "tp", "dim"), [((4, 2, 2), 2, 0), ((6, 6, 6), 3, 1), ((8, 8), 4, 0)])
def test_rank_major_order_gives_each_rank_its_part_of_every_block(blocks, tp, dim):
    layout = FusedLayout(dim=dim, blocks=blocks, tp_size=tp)
    rows = sum(blocks)
    whole = torch.arange(rows).repeat(3, 1).T.contiguous() if dim == 0 else torch.arange(rows).repeat(3, 1)
    ordered = layout.to_rank_major(whole)
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    for rank, chunk in enumerate(ordered.chunk(tp, dim=dim)):
        expected = torch.cat([torch.arange(s + rank * b // tp, s + (rank + 1) * b // tp) for s, b in zip(starts, blocks)])
        index = chunk[:, 0] if dim == 0 else chunk[0]
        assert torch.equal(index, expected)
    assert torch.equal(layout.to_original(ordered), whole)
