"""Plans inferred for Hugging Face models (built from tiny configs, nothing downloaded), and fused layouts."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.parallelize.tensor.fused import FusedLayout
from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig, check_plan

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
    # Tied to the embedding: both split over the vocabulary (tied again after sharding).
    assert gpt2.styles["net.lm_head"] == "colwise_gather_output"
    assert gpt2.styles["net.transformer.wte"] == "embedding_rowwise"
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


def other_plan(family: str, tp_size: int | None = 2, attention: str = "sdpa"):
    from tests.hf_models import make_hf_model

    model = make_hf_model(family, attention=attention)
    return model, TensorParallelConfig().resolve(model, warn=lambda _: None, tp_size=tp_size)


def test_bert_attention_and_mlp_split_across_sibling_modules():
    model, resolved = other_plan("bert")
    layer = "net.bert.encoder.layer.0"
    for name in ("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"):
        assert resolved.styles[f"{layer}.{name}"] == "colwise"
    assert resolved.styles[f"{layer}.attention.output.dense"] == "rowwise"
    assert resolved.styles[f"{layer}.output.dense"] == "rowwise"
    # The heads' total width shrinks with their count; a head's own width (attention_head_size) does not.
    assert resolved.head_attributes[f"{layer}.attention.self"] == ("num_attention_heads", "all_head_size", "config.num_attention_heads")
    assert not resolved.kept_whole
    check_plan(model, resolved, 2)


def test_falcon_multi_query_attention_splits_its_queries_and_gathers_its_key_value_head():
    model, resolved = other_plan("falcon")
    block = "net.transformer.h.0"
    # FalconLinear (an nn.Linear subclass computing x @ W.T + b) is a projection.
    assert resolved.styles[f"{block}.mlp.dense_h_to_4h"] == "colwise"
    assert resolved.styles[f"{block}.mlp.dense_4h_to_h"] == "rowwise"
    # One k/v head: q | k | v blocks, the queries split by heads, the k/v head gathered after the projection.
    assert resolved.styles[f"{block}.self_attention.query_key_value"] == "fused_qkv"
    assert resolved.styles[f"{block}.self_attention.dense"] == "rowwise"
    assert f"{block}.self_attention.query_key_value" in resolved.multi_query
    attributes = set(resolved.head_attributes[f"{block}.self_attention"])
    assert {"num_heads", "num_key_value_groups"} <= attributes and "num_kv_heads" not in attributes
    assert not resolved.kept_whole
    check_plan(model, resolved, 2)


def test_falcon_grouped_and_bloom_query_key_value_are_split_by_whole_groups():
    model, resolved = other_plan("falcon_grouped")
    attention = "net.transformer.h.0.self_attention"
    assert resolved.styles[f"{attention}.query_key_value"] == "colwise"
    assert resolved.heads[f"{attention}.query_key_value"] == (4, 2)
    assert {"num_heads", "num_kv_heads"} <= set(resolved.head_attributes[attention])
    check_plan(model, resolved, 2)
    # 2 groups cannot go to 4 ranks, but would go to 2: the degree is refused, not the attention left whole.
    with pytest.raises(ValueError, match=r"query_key_value: its 2 key/value heads cannot be divided among tensor_parallel_size=4"):
        other_plan("falcon_grouped", tp_size=4)
    # One k/v head (multi-query) at tp=4: one query head per rank, the 8-wide k/v head gathered from parts of 2.
    _, falcon = other_plan("falcon", tp_size=4)
    assert not falcon.kept_whole and f"{attention}.query_key_value" in falcon.multi_query
    model, resolved = other_plan("bloom", attention="eager")
    assert resolved.styles[f"{attention}.query_key_value"] == "colwise"
    assert resolved.heads[f"{attention}.query_key_value"] == (4, 4)
    assert resolved.head_attributes[attention] == ("num_heads", "split_size")
    check_plan(model, resolved, 2)


def test_litgpt_fused_qkv_reads_its_query_groups_from_the_config():
    pytest.importorskip("litgpt")
    from tests.hf_models import LitGPTLM

    model = LitGPTLM()
    resolved = TensorParallelConfig().resolve(model, warn=lambda _: None, tp_size=2)
    qkv = "net.transformer.h.0.attn.qkv"
    # litgpt >= 0.5 lays qkv out as q | k | v blocks: 4 query heads and 2 query groups of width 8.
    assert resolved.styles[qkv] == "fused_qkv" and resolved.fused[qkv] == (32, 16, 16)
    assert resolved.heads[qkv] == (4, 2)
    assert resolved.head_attributes["net.transformer.h.0.attn"] == ("config.n_head", "config.n_query_groups")
    check_plan(model, resolved, 2)
    with pytest.raises(ValueError, match=r"qkv: its 2 key/value heads cannot be divided among tensor_parallel_size=4"):
        check_plan(model, TensorParallelConfig().resolve(model, warn=lambda _: None), 4)
