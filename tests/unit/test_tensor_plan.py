"""Tensor-parallel plans: pattern resolution, automatic inference, validation (no processes)."""

import pytest
from torch import nn

from lightning_parallel.parallelize.tensor import (
    check_plan,
    infer_plan,
    resolve_plan,
)
from lightning_parallel.parallelize.tensor_plan import ResolvedPlan
from recipes.models.gpt import GPT


def tiny_gpt(tie_weights: bool = True) -> GPT:
    return GPT(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.0, tie_weights=tie_weights)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)


class LlamaishAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)


class LlamaishBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(16)
        self.attention = LlamaishAttention(16, n_heads=4, n_kv_heads=2)
        self.feed_forward = SwiGLU(16, 48)


class FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_head = 2
        self.c_attn = nn.Linear(8, 24)
        self.c_proj = nn.Linear(8, 8)


def test_auto_plan_for_the_recipe_gpt():
    plan = infer_plan(tiny_gpt())
    assert plan == {
        **{f"blocks.{i}.attn.{p}": "colwise" for i in range(2) for p in ("q_proj", "k_proj", "v_proj")},
        **{f"blocks.{i}.attn.out_proj": "rowwise" for i in range(2)},
        **{f"blocks.{i}.mlp.fc_in": "colwise" for i in range(2)},
        **{f"blocks.{i}.mlp.fc_out": "rowwise" for i in range(2)},
    }
    resolved = resolve_plan(tiny_gpt(), plan)
    assert resolved.head_attributes == {"blocks.0.attn": ("n_head",), "blocks.1.attn": ("n_head",)}
    check_plan(tiny_gpt(), resolved, 2)
    assert "blocks.0.attn.n_head ÷ tp" in resolved.describe()


def test_auto_plan_for_other_names_swiglu_and_grouped_query_attention():
    plan = infer_plan(LlamaishBlock())
    assert plan == {
        "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
        "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
    }
    resolved = resolve_plan(LlamaishBlock(), plan)
    assert resolved.head_attributes == {"attention": ("n_heads", "n_kv_heads")}
    check_plan(LlamaishBlock(), resolved, 2)
    with pytest.raises(ValueError, match=r"attention.n_kv_heads=2 is not divisible by tensor_parallel_size=4"):
        check_plan(LlamaishBlock(), resolved, 4)


def test_fused_qkv_is_split_by_blocks_and_multihead_attention_stays_replicated():
    warnings = []
    model = nn.ModuleDict({"fused": FusedAttention(), "mha": nn.MultiheadAttention(8, 2)})
    assert infer_plan(model, warn=warnings.append) == {"fused.c_attn": "fused_qkv", "fused.c_proj": "rowwise"}
    assert resolve_plan(model, infer_plan(model)).fused == {"fused.c_attn": (8, 8, 8)}
    assert any("mha" in w and "MultiheadAttention" in w for w in warnings)


def test_fused_projection_of_unknown_layout_is_refused_or_left_whole():
    class Ambiguous(nn.Module):  # query_key_value without a published plan: interleaved or blocks?
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 2
            self.query_key_value, self.dense = nn.Linear(8, 24), nn.Linear(8, 8)

    warnings = []
    assert infer_plan(Ambiguous(), warn=warnings.append) == {}
    assert any("query_key_value" in w and "unknown layout" in w for w in warnings)
    narrow = FusedAttention()
    narrow.c_attn = nn.Linear(8, 20)  # not q|k|v for 2 heads of any width
    with pytest.raises(ValueError, match=r"c_attn: out_features=20 is not q\|k\|v for 2 query and 2 key/value heads"):
        resolve_plan(narrow, {"c_attn": "fused_qkv"})


def test_patterns_resolve_to_module_names():
    resolved = resolve_plan(tiny_gpt(), {"blocks.*.mlp.fc_in": "colwise", "blocks.*.mlp.fc_out": "rowwise", "ln_f": "replicate"})
    assert resolved.styles == {
        "blocks.0.mlp.fc_in": "colwise", "blocks.1.mlp.fc_in": "colwise",
        "blocks.0.mlp.fc_out": "rowwise", "blocks.1.mlp.fc_out": "rowwise", "ln_f": "replicate",
    }
    assert resolved.head_attributes == {}


def test_pattern_matching_nothing_lists_near_matches():
    with pytest.raises(ValueError, match=r"'blocks\.\*\.mlp\.fc1' matches no submodule of GPT\. Near matches: .*blocks\.\d\.mlp\.fc_in"):
        resolve_plan(tiny_gpt(), {"blocks.*.mlp.fc1": "colwise"})


def test_unknown_style_and_conflicting_styles():
    with pytest.raises(ValueError, match=r"style 'diagonal' is unknown\. Choose one of: colwise, colwise_gather_output"):
        resolve_plan(tiny_gpt(), {"ln_f": "diagonal"})
    with pytest.raises(ValueError, match="matched with two styles"):
        resolve_plan(tiny_gpt(), {"blocks.0.mlp.fc_in": "colwise", "blocks.*.mlp.fc_in": "rowwise"})


def test_sizes_not_divisible_name_module_and_numbers():
    resolved = resolve_plan(tiny_gpt(), infer_plan(tiny_gpt()))
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.q_proj\.out_features=16 is not divisible by tensor_parallel_size=3"):
        check_plan(tiny_gpt(), resolved, 3)
    wide_heads = GPT(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0, tie_weights=False)
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.n_head=2 is not divisible by tensor_parallel_size=4"):
        check_plan(wide_heads, resolve_plan(wide_heads, infer_plan(wide_heads)), 4)


def test_styles_must_fit_the_module_type():
    with pytest.raises(TypeError, match=r"ln_f: style 'colwise' needs an nn.Linear or a transformers Conv1D, got LayerNorm"):
        check_plan(tiny_gpt(), ResolvedPlan(styles={"ln_f": "colwise"}, head_attributes={}), 2)


def test_splitting_one_side_of_tied_weights_is_refused():
    model = tiny_gpt(tie_weights=True)
    with pytest.raises(ValueError, match=r"tied .* splits only lm_head"):
        check_plan(model, resolve_plan(model, {"lm_head": "colwise"}), 2)
    untied = tiny_gpt(tie_weights=False)
    check_plan(untied, resolve_plan(untied, {"lm_head": "colwise", "tok_emb": "embedding_rowwise"}), 2)
    assert resolve_plan(untied, {"tok_emb": "vocab_parallel"}).styles == {"tok_emb": "embedding_rowwise"}
