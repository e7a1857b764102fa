"""Tensor-parallel plans: pattern resolution, automatic inference, validation (no processes)."""

import pytest
import torch
from torch import nn

from lightning_parallel.parallelize.tensor.apply import (
    check_plan,
    infer_plan,
    resolve_plan,
)
from lightning_parallel.parallelize.tensor.inference import infer_units
from lightning_parallel.parallelize.tensor.plan import ResolvedPlan
from recipes.models.gpt import GPT
from tests.unit.tp_simulated import split_and_run, whole_run


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
        # Tied (one tensor): split together over the vocabulary, and tied again after sharding.
        "tok_emb": "embedding_rowwise", "lm_head": "colwise_gather_output",
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


class GroupedAttention(nn.Module):
    """A fused query_key_value laid out per key/value head, as GPT-NeoX, BLOOM and Falcon lay it out."""

    def __init__(self, num_heads: int | None = 2, num_kv_heads: int | None = None, head_dim: int = 4) -> None:
        super().__init__()
        if num_heads is not None:
            self.num_heads = num_heads
        if num_kv_heads is not None:
            self.num_kv_heads = num_kv_heads
        heads, kv = num_heads or 2, num_kv_heads or num_heads or 2
        self.query_key_value = nn.Linear(heads * head_dim, (heads + 2 * kv) * head_dim)
        self.dense = nn.Linear(heads * head_dim, heads * head_dim)


def test_fused_projection_of_unknown_layout_is_refused_or_left_whole():
    warnings = []
    assert infer_plan(GroupedAttention(num_heads=None), warn=warnings.append) == {}  # no head counts: layout unknown
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
    with pytest.raises(ValueError, match=r"tied \(one tensor\), but the plan does not split it the same way in every module "
                                         r"holding it \(lm_head: colwise, tok_emb: replicated\)"):
        check_plan(model, resolve_plan(model, {"lm_head": "colwise"}), 2)
    # Both holders split by the vocabulary rows: one shard of the one tensor on every rank.
    check_plan(model, resolve_plan(model, {"lm_head": "colwise_gather_output", "tok_emb": "embedding_rowwise"}), 2)
    untied = tiny_gpt(tie_weights=False)
    check_plan(untied, resolve_plan(untied, {"lm_head": "colwise", "tok_emb": "embedding_rowwise"}), 2)
    assert resolve_plan(untied, {"tok_emb": "vocab_parallel"}).styles == {"tok_emb": "embedding_rowwise"}


def test_query_key_value_is_split_by_whole_key_value_groups():
    # As many k/v heads as query heads (per-head interleaved), two groups: a plain column split gives whole groups.
    for attention, heads in ((GroupedAttention(4), (4, 4)), (GroupedAttention(4, 2), (4, 2))):
        plan = infer_plan(attention)
        assert plan == {"query_key_value": "colwise", "dense": "rowwise"}
        assert resolve_plan(attention, plan).heads == {"query_key_value": heads}
    check_plan(GroupedAttention(4, 2), resolve_plan(GroupedAttention(4, 2), infer_plan(GroupedAttention(4, 2))), 2)
    # One k/v head (multi-query): blocks q | k | v, split as a fused q|k|v whose one k/v head is gathered whole.
    mqa = GroupedAttention(4, 1)
    assert infer_plan(mqa) == {"query_key_value": "fused_qkv", "dense": "rowwise"}
    resolved = resolve_plan(mqa, infer_plan(mqa))
    assert resolved.multi_query == {"query_key_value"} and resolved.fused == {"query_key_value": (16, 4, 4)}
    # The query heads shrink per rank, the one k/v head does not.
    assert resolved.head_attributes == {"": ("num_heads",)}
    check_plan(mqa, resolved, 2)


def test_a_single_key_value_head_in_fused_blocks_is_gathered_not_cut_into_heads():
    class MultiQuery(FusedAttention):
        def __init__(self, head_dim: int = 4) -> None:
            super().__init__()
            self.n_head, self.n_kv_heads, self.embed_dim, self.num_key_value_groups = 2, 1, 2 * head_dim, 2
            self.c_attn = nn.Linear(8, 4 * head_dim)  # q | k | v = 2·d | d | d

    model = MultiQuery()
    resolved = resolve_plan(model, {"c_attn": "fused_qkv", "c_proj": "rowwise"}, head_attributes=("n_head", "n_kv_heads"))
    assert resolved.heads == {"c_attn": (2, 1)} and resolved.multi_query == {"c_attn"}
    # n_kv_heads stays 1; the query width the module splits by and the queries per k/v head shrink with the queries.
    assert resolved.head_attributes[""] == ("n_head", "embed_dim", "num_key_value_groups")
    assert "c_attn → fused_qkv blocks 8|4|4 (one k/v head, gathered)" in resolved.describe()
    check_plan(model, resolved, 2)
    # The k/v head's features are split before the gather: a head width the degree does not divide is refused.
    odd = MultiQuery(head_dim=3)
    with pytest.raises(ValueError, match=r"c_attn\.k block=3 is not divisible by tensor_parallel_size=2"):
        check_plan(odd, resolve_plan(odd, {"c_attn": "fused_qkv", "c_proj": "rowwise"}, head_attributes=("n_head",)), 2)


class SelfAttention(nn.Module):  # BERT's attention.self: q/k/v only
    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.num_attention_heads, self.attention_head_size, self.all_head_size = heads, dim // heads, dim
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)


class SelfOutput(nn.Module):  # BERT's attention.output / output: dense, then a norm of the model width
    def __init__(self, d_in: int = 8, d_out: int = 8) -> None:
        super().__init__()
        self.dense, self.LayerNorm = nn.Linear(d_in, d_out), nn.LayerNorm(d_out)


class Intermediate(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.dense, self.act = nn.Linear(dim, hidden), nn.GELU()


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.self, self.attention.output = SelfAttention(), SelfOutput()
        self.intermediate, self.output = Intermediate(), SelfOutput(16, 8)


def test_attention_and_mlp_split_across_sibling_modules():
    plan = infer_plan(EncoderLayer())
    assert plan == {
        "attention.self.query": "colwise", "attention.self.key": "colwise", "attention.self.value": "colwise",
        "attention.output.dense": "rowwise", "intermediate.dense": "colwise", "output.dense": "rowwise",
    }
    resolved = resolve_plan(EncoderLayer(), plan)
    # Head counts and the heads' total width shrink; a head's own width does not.
    assert resolved.head_attributes == {"attention.self": ("num_attention_heads", "all_head_size")}
    check_plan(EncoderLayer(), resolved, 2)


def test_sibling_modules_holding_more_than_the_pair_are_left_whole():
    layer = EncoderLayer()
    layer.attention.self.relative_bias = nn.Parameter(torch.zeros(2, 4))  # per-head state the split would not follow
    layer.intermediate.norm = nn.LayerNorm(16)  # a norm over the split width: it needs every feature
    assert infer_plan(layer) == {}


def test_auto_plan_that_splits_nothing_is_refused_with_the_reason():
    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig

    config = TensorParallelConfig()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 with plan='auto' splits nothing in MultiheadAttention(.|\n)*keeps q/k/v fused"):
        config.resolve(nn.MultiheadAttention(8, 2), warn=lambda _: None, tp_size=2)
    # Every attention of a multi-query model whose head width tp=2 does not divide stays whole and there is no MLP:
    # named, refused.
    with pytest.raises(ValueError, match=r"splits nothing in GroupedAttention(.|\n)*What stays whole, and why:\n  query_key_value"):
        config.resolve(GroupedAttention(4, 1, head_dim=3), warn=lambda _: None, tp_size=2)
    assert config.resolve(GroupedAttention(4, 1, head_dim=3), warn=lambda _: None, tp_size=1).styles  # no TP: nothing to refuse


class SameMap(nn.Linear):  # FalconLinear: the same map, written out
    def forward(self, x):
        return x @ self.weight.T if self.bias is None else x @ self.weight.T + self.bias


class Scaled(nn.Linear):  # a LoRA-like layer: something more than x @ W.T + b
    def forward(self, x):
        return super().forward(x) * 2


class NoOverride(nn.Linear):
    pass


def test_linear_subclasses_are_projections_only_if_they_compute_the_linear_map():
    from lightning_parallel.parallelize.tensor.projections import is_projection

    assert is_projection(SameMap(4, 8)) and is_projection(NoOverride(4, 8))
    assert not is_projection(Scaled(4, 8))
    mlp = nn.Module()
    mlp.up, mlp.down = Scaled(8, 16), Scaled(16, 8)
    assert infer_plan(mlp) == {}
    mlp.up, mlp.down = SameMap(8, 16), SameMap(16, 8)
    assert infer_plan(mlp) == {"up": "colwise", "down": "rowwise"}
    mlp.up = Scaled(8, 16)
    with pytest.raises(TypeError, match=r"needs an nn.Linear or a transformers Conv1D, got Scaled \(an nn.Linear subclass"):
        check_plan(mlp, ResolvedPlan(styles={"up": "colwise"}, head_attributes={}), 2)


class _Mesh:  # what the per-head hook reads of a 1-D tensor-parallel mesh
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


class AlibiAttention(GroupedAttention):
    def forward(self, hidden_states, residual, alibi, attention_mask=None):
        return alibi


@pytest.mark.parametrize("as_keyword", [True, False])
def test_alibi_biases_are_cut_to_the_heads_of_each_rank(as_keyword):
    from lightning_parallel.parallelize.tensor.head_inputs import slice_per_head_inputs

    batch, heads, keys = 3, 4, 5
    # BLOOM's layout [batch·heads, 1, keys]; each bias holds its head's index.
    alibi = torch.arange(heads, dtype=torch.float64).repeat(batch)[:, None, None].expand(batch * heads, 1, keys)
    hidden = torch.zeros(batch, 7, 8)
    for rank in range(2):
        attention = AlibiAttention(num_heads=heads)
        plan = infer_plan(attention)
        slice_per_head_inputs(dict(attention.named_modules()), resolve_plan(attention, plan), _Mesh(2, rank))
        cut = attention(hidden, hidden, alibi=alibi) if as_keyword else attention(hidden, hidden, alibi)
        assert cut.shape == (batch * 2, 1, keys)
        assert cut[:, 0, 0].tolist() == [2.0 * rank, 2.0 * rank + 1] * batch
    # [batch, heads, q, k] biases (and [heads, q, k]) are cut along their head dimension.
    per_head = torch.arange(heads, dtype=torch.float64)[None, :, None, None].expand(batch, heads, 1, keys)
    assert attention(hidden, hidden, per_head)[0, :, 0, 0].tolist() == [2.0, 3.0]
    assert attention(hidden, hidden, per_head[0])[:, 0, 0].tolist() == [2.0, 3.0]
    with pytest.raises(RuntimeError, match=r"alibi of shape \(7, 1, 5\) has no dimension of its 4 heads"):
        attention(hidden, hidden, torch.zeros(7, 1, 5))


# --- Split regions: replicated parameters used on a rank's slice, and what cannot run on a slice -------------


class UnitNorm(nn.Module):
    """Scales to unit length (not an RMSNorm or LayerNorm: its statistic is not recognised for a split width)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x / (x.norm(dim=-1, keepdim=True) + self.eps)


class NormedAttention(nn.Module):
    """4 query, 2 key/value heads of width 4, with a norm per head (Qwen3) or over the whole k width (OLMo2),
    and a replicated pre-norm of the input width."""

    def __init__(self, whole_width_norm: bool = False, latent: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, 4
        self.pre_norm = nn.LayerNorm(16)
        self.q_proj, self.o_proj = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)
        self.k_proj, self.v_proj = nn.Linear(16, 8, bias=False), nn.Linear(16, 8, bias=False)
        self.q_norm = nn.LayerNorm(4)
        self.k_norm = UnitNorm(8) if whole_width_norm else nn.Identity()
        if latent:  # a replicated projection beside the split ones (DeepSeek's kv_a_proj_with_mqa)
            self.kv_a_proj = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre_norm(x)
        q = self.q_norm(self.q_proj(x).view(*x.shape[:-1], -1, self.head_dim)).flatten(-2)
        k, v = (t.view(*x.shape[:-1], -1, self.head_dim).repeat_interleave(2, -2).flatten(-2)
                for t in (self.k_norm(self.k_proj(x)), self.v_proj(x)))
        return self.o_proj(q * k + v)


def test_per_head_norm_gradient_is_summed_over_the_group_and_the_pre_norm_is_not(monkeypatch):
    from lightning_parallel.parallelize.tensor import split_region

    reduced: list[int] = []

    def fake_all_reduce(tensor, op=None, group=None):  # two ranks holding the same partial sum
        reduced.append(tensor.numel())
        tensor.mul_(2)

    monkeypatch.setattr(split_region.dist, "all_reduce", fake_all_reduce)
    model = NormedAttention()
    wrapper = nn.ModuleDict({"attn": model})
    resolved = resolve_plan(wrapper, infer_plan(wrapper))
    assert split_region.split_regions(resolved) == {"attn": (["q_proj", "k_proj", "v_proj"], ["o_proj"])}
    check_plan(wrapper, resolved, 2)  # a norm of the input width (pre_norm) is no whole-width norm over the split

    class Mesh:
        def get_group(self):
            return None

        def size(self):
            return 2

        def get_local_rank(self):
            return 0

    x = torch.randn(2, 3, 16)
    model(x).sum().backward()  # what each of two identical ranks computes
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    split_region.track_split_region_parameters(dict(wrapper.named_modules()), resolved, Mesh())
    model.zero_grad()
    model(x).sum().backward()
    # The q_norm weight and bias (a partial sum per rank) are summed, in one all-reduce; nothing else.
    assert split_region.reduce_split_region_gradients(wrapper) == 2 and reduced == [8]
    torch.testing.assert_close(model.q_norm.weight.grad, 2 * expected["q_norm.weight"])
    torch.testing.assert_close(model.pre_norm.weight.grad, expected["pre_norm.weight"])
    torch.testing.assert_close(model.q_proj.weight.grad, expected["q_proj.weight"])


def test_a_norm_over_the_whole_split_width_is_refused_when_called_on_a_slice():
    from lightning_parallel.parallelize.tensor import split_region

    from types import SimpleNamespace

    mesh = SimpleNamespace(get_group=lambda: None, size=lambda: 2)  # a tp2 mesh, as far as the tracker asks
    tracker = split_region.SplitRegionParameters(mesh, "attn")
    norm = nn.LayerNorm(16)  # the whole q width, which is also the input width: only the call tells
    tracker._open()
    with pytest.raises(RuntimeError, match=r"attn\.q_norm\.weight has the whole split width 16.*this rank's 8 features"):
        tracker._called("q_norm", norm, norm, (torch.randn(2, 8),))


def test_norm_over_the_whole_split_width_leaves_the_attention_whole():
    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig

    model = nn.ModuleDict({"attn": NormedAttention(whole_width_norm=True), "mlp": SwiGLU(16, 32)})
    with pytest.raises(ValueError, match=r"attn\.k_norm\.weight: its width 8 is the whole output width of the split attn\.k_proj"):
        check_plan(model, resolve_plan(model, infer_plan(model)), 2)
    resolved = TensorParallelConfig().resolve(model, warn=lambda _: None, tp_size=2)
    assert "attn.q_proj" not in resolved.styles and "mlp.w1" in resolved.styles
    assert "not per head" in resolved.kept_whole["attn"]


def test_replicated_projection_beside_split_ones_leaves_the_attention_whole():
    model = nn.ModuleDict({"attn": NormedAttention(latent=True)})
    with pytest.raises(ValueError, match=r"attn\.kv_a_proj: a projection left replicated inside attn"):
        check_plan(model, resolve_plan(model, {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise", "attn.o_proj": "rowwise"}), 2)
    # A row-wise projection left alone (its column-wise partners refused) is refused too.
    with pytest.raises(ValueError, match="left replicated inside attn"):
        check_plan(model, resolve_plan(model, {"attn.o_proj": "rowwise"}), 2)


class InterleavedQKVAttention(nn.Module):
    """CodeGen's layout: qkv rows in mp_num groups, each q_g | v_g | k_g."""

    def __init__(self) -> None:
        super().__init__()
        self.num_attention_heads, self.mp_num = 4, 4
        self.qkv_proj = nn.Linear(16, 48, bias=False)
        self.out_proj = nn.Linear(16, 16, bias=False)


def test_interleaved_fused_qkv_is_split_by_whole_groups():
    model = nn.ModuleDict({"attn": InterleavedQKVAttention()})
    plan = infer_plan(model, warn=lambda _: None)
    assert plan == {"attn.qkv_proj": "colwise", "attn.out_proj": "rowwise"}
    check_plan(model, resolve_plan(model, plan), 2)
    model.attn.num_attention_heads, model.attn.mp_num = 8, 2  # 8 heads divide by 4; 2 groups do not
    with pytest.raises(ValueError, match=r"interleaved in mp_num=2 model-parallel groups.*tensor_parallel_size=4"):
        check_plan(model, resolve_plan(model, plan), 4)


def test_a_layer_holding_blocks_is_not_taken_for_an_mlp():
    class Layer(nn.Module):  # Gemma4: a per-layer input gate and projection beside attention and MLP
        def __init__(self) -> None:
            super().__init__()
            self.self_attn, self.mlp = NormedAttention(), SwiGLU(16, 32)
            self.per_layer_input_gate, self.per_layer_projection = nn.Linear(16, 8), nn.Linear(8, 16)

    plan = infer_plan(nn.ModuleDict({"layer": Layer()}), warn=lambda _: None)
    assert "layer.per_layer_input_gate" not in plan and plan["layer.self_attn.q_proj"] == "colwise"


# --- What the coverage sweep found under tp2 (issue 29): per-head parameters, other widths, clear refusals ------

class HeadsAttention(nn.Module):
    """q/k/v/o, 4 heads; ``extra`` picks what the coverage sweep's families do beside them."""

    def __init__(self, extra: str = "", dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.extra = heads, dim // heads, extra
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim, dtype=torch.float64) for _ in range(4))
        if extra == "sinks":  # gpt-oss, GraniteSWA, MiMo: one logit per head beside the keys'
            self.sinks = nn.Parameter(torch.linspace(-1, 1, heads, dtype=torch.float64))
        if extra == "embed_dim":  # XGLM, MVP: the heads' output reshaped by the split width, kept as embed_dim
            self.embed_dim = dim
        if extra == "bias_table":  # Swin: a relative-position table with the heads last, [positions, heads]
            self.table = nn.Parameter(torch.randn(9, heads, dtype=torch.float64))

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = (p(x).view(B, L, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5
        if self.extra == "bias_table":  # every head's bias, added in place as Swin does
            scores += self.table[: L * L % 9 or 1].mean(0).view(1, -1, 1, 1)
        if self.extra == "sinks":
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            scores = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
        else:
            scores = scores.softmax(-1)
        out = (scores @ v).transpose(1, 2)
        if self.extra == "chunk_heads":  # DiffLlama: head h paired with head h + H/2
            first, second = torch.chunk(out, 2, dim=2)
            out = torch.cat([first - 0.5 * second, second], dim=2)
        if self.extra == "input_width":  # TrOCR: reshaped by the width of its (whole) input
            return self.o_proj(out.reshape(B, L, x.shape[-1]))
        width = self.embed_dim if self.extra == "embed_dim" else self.num_heads * self.head_dim
        return self.o_proj(out.reshape(B, L, width))


@pytest.mark.parametrize("extra", ["sinks", "embed_dim"])
def test_per_head_parameters_and_split_widths_follow_the_heads(simulated_ranks, extra):
    # Attention sinks ([num_heads] on the attention module) crashed with a head-count mismatch; embed_dim (the
    # split width XGLM reshapes by) was not divided: "shape '[8, 16, 32]' is invalid".
    import copy

    torch.manual_seed(0)
    module, x = HeadsAttention(extra), torch.randn(2, 5, 32, dtype=torch.float64)
    expected = whole_run(copy.deepcopy(module), x)
    out, grads, resolved = split_and_run(module, simulated_ranks, x)
    if extra == "sinks":
        assert resolved.per_head == {"": ("sinks",)}
        assert module.sinks.placements[0].is_shard(0)
    else:
        assert "embed_dim" in resolved.head_attributes[""]
    torch.testing.assert_close(out, expected[0], rtol=0, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][name], rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("extra, match", [
    ("chunk_heads", r"splits its 2 heads on this rank into groups"),
    ("input_width", r"failed on this rank's heads after the tensor-parallel split: shape"),
    ("bias_table", r"failed on this rank's heads after the tensor-parallel split: output with shape \[2, 1, 5, 5\]"),
])
def test_attention_computing_across_heads_or_with_its_input_width_is_refused(simulated_ranks, extra, match):
    # DiffLlama's head pairing was silently wrong (5.9e-3); TrOCR's reshape and Swin's in-place table bias (every
    # head's, on this rank's heads) crashed deep in torch.
    module = HeadsAttention(extra, heads=2 if extra == "bias_table" else 4)  # Swin's case: one head on a rank
    with pytest.raises(RuntimeError, match=match):
        split_and_run(module, simulated_ranks, torch.randn(2, 5, 32, dtype=torch.float64))


class Swapping(nn.Module):  # BigBird: the attention module replaced in forward (block-sparse → full)
    def __init__(self) -> None:
        super().__init__()
        self.attn = HeadsAttention()

    def forward(self, x):
        fresh = HeadsAttention()
        fresh.q_proj, fresh.k_proj, fresh.v_proj, fresh.o_proj = self.attn.q_proj, self.attn.k_proj, self.attn.v_proj, self.attn.o_proj
        self.attn = fresh
        return self.attn(x)


def test_attention_replaced_in_forward_is_refused(simulated_ranks):
    with pytest.raises(RuntimeError, match=r"attn was replaced during forward by a new HeadsAttention"):
        split_and_run(Swapping(), simulated_ranks, torch.randn(2, 5, 32, dtype=torch.float64))


def test_rowwise_without_a_split_input_and_embeddings_with_more_parameters_are_refused():
    # inkling_text: a published "rowwise_split_input" head (its input is whole) and an embedding holding a norm
    # of its own ("parameter name can't contain '.'" inside torch's split).
    class NormedEmbedding(nn.Embedding):
        def __init__(self) -> None:
            super().__init__(32, 16)
            self.embed_norm = nn.LayerNorm(16)

    model = nn.ModuleDict({"embed": NormedEmbedding(), "head": nn.Linear(16, 32)})
    with pytest.raises(ValueError, match=r"head: style 'rowwise' reads its input split over the ranks"):
        check_plan(model, resolve_plan(model, {"head": "rowwise"}), 2)
    with pytest.raises(TypeError, match=r"also holds embed_norm.weight, embed_norm.bias"):
        check_plan(model, resolve_plan(model, {"embed": "embedding_rowwise"}), 2)


def test_rowwise_projection_to_another_width_inside_attention_is_refused():
    # Doge: dt_proj (row-wise in its published plan) maps every head's values to one value per head, used
    # beside this rank's heads only.
    model = nn.ModuleDict({"attn": HeadsAttention()})
    model.attn.dt_proj = nn.Linear(32, 4)
    plan = {**infer_plan(model), "attn.dt_proj": "rowwise"}
    with pytest.raises(ValueError, match=r"attn.dt_proj: a row-wise projection to 4 features inside attn"):
        check_plan(model, resolve_plan(model, plan), 2)


def test_a_parameter_as_long_as_both_the_head_count_and_a_head_is_refused():
    attention = HeadsAttention("sinks", dim=16)  # 4 heads of width 4: sinks are one per head by their name, but
    attention.lambda_q1 = nn.Parameter(torch.zeros(4, dtype=torch.float64))  # this: one per head, or per feature?
    with pytest.raises(ValueError, match=r"lambda_q1: its 4 entries may be one per head .* or one per feature of a head \(head_dim=4"):
        resolve_plan(attention, infer_plan(attention))


class LatentAttention(nn.Module):
    """Multi-head latent attention as DeepSeek-V3 writes it: query and key/value latents projected down
    (replicated), normalised, projected up per head (split); a rotary key part shared by every head."""

    def __init__(self) -> None:
        super().__init__()
        self.heads, self.nope, self.rope = 4, 4, 2
        self.q_a_proj, self.q_a_layernorm = nn.Linear(16, 8, bias=False), nn.LayerNorm(8)
        self.q_b_proj = nn.Linear(8, 4 * 6, bias=False)
        self.kv_a_proj_with_mqa, self.kv_a_layernorm = nn.Linear(16, 8 + 2, bias=False), nn.LayerNorm(8)
        self.kv_b_proj = nn.Linear(8, 4 * (4 + 4), bias=False)
        self.o_proj = nn.Linear(4 * 4, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(*x.shape[:-1], -1, 6)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([8, 2], dim=-1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(latent)).view(*x.shape[:-1], -1, 8).split([4, 4], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(-2).expand(*k_nope.shape[:-1], 2)], dim=-1)
        return self.o_proj(((q * k).sum(-1, keepdim=True) * v).flatten(-2))


def test_latent_attention_splits_its_up_projections_and_keeps_its_latents_replicated():
    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig

    model = nn.ModuleDict({"attn": LatentAttention()})
    resolved = TensorParallelConfig().resolve(model, warn=lambda _: None, tp_size=2)
    assert {fqn: style for fqn, style in resolved.styles.items()} == {
        "attn.q_b_proj": "colwise", "attn.kv_b_proj": "colwise", "attn.o_proj": "rowwise"}
    assert resolved.latent == {"attn": ("attn.q_a_proj", "attn.kv_a_proj_with_mqa")}
    assert "attn.kv_a_proj_with_mqa stays replicated: latent projection" in resolved.describe()
    check_plan(model, resolved, 2)  # no longer refused as "a projection left replicated inside"


def test_latent_attention_refuses_sequence_parallelism_by_name():
    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig, apply_tensor_parallel

    model = nn.ModuleDict({"attn": LatentAttention()})
    resolved = TensorParallelConfig().resolve(model, warn=lambda _: None, tp_size=2)

    class Mesh:
        def size(self):
            return 2

    with pytest.raises(ValueError, match=r"sequence_parallel=True: attn keeps its latent projections .*sequence_parallel=False"):
        apply_tensor_parallel(model, Mesh(), resolved, sequence_parallel=True)


class GatedAttention(nn.Module):
    """q/k/v/o with a gate per output feature (AFMoE's gate_proj) and one per head (LFM's g_proj)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 4
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(16, 16, bias=False) for _ in range(4))
        self.gate_proj, self.g_proj = nn.Linear(16, 16, bias=False), nn.Linear(16, 4, bias=False)


def test_per_head_gates_split_with_their_attention():
    resolved = infer_plan(nn.ModuleDict({"attn": GatedAttention()}))
    assert resolved == {**{f"attn.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "g_proj")},
                        "attn.o_proj": "rowwise"}


def test_a_gated_mlp_named_by_convention_splits_even_when_square():
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = (nn.Linear(16, 16) for _ in range(3))
    assert infer_plan(nn.ModuleDict({"mlp": mlp})) == {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def test_sibling_mlp_with_a_norm_of_the_model_width_before_its_up_projection():
    intermediate, output = nn.Module(), nn.Module()
    intermediate.LayerNorm, intermediate.dense = nn.LayerNorm(16), nn.Linear(16, 64)
    output.dense = nn.Linear(64, 16)
    layer = nn.Module()
    layer.intermediate, layer.output = intermediate, output
    assert infer_plan(nn.ModuleDict({"layer": layer})) == {"layer.intermediate.dense": "colwise", "layer.output.dense": "rowwise"}


def test_a_token_embedding_and_head_split_over_the_vocabulary_tied_or_not():
    untied = nn.ModuleDict({"embed": nn.Embedding(64, 16), "head": nn.Linear(16, 64, bias=False)})
    assert infer_units(untied) == [{"embed": "embedding_rowwise"}, {"head": "colwise_gather_output"}]
    tied = nn.ModuleDict({"embed": nn.Embedding(64, 16), "head": nn.Linear(16, 64, bias=False)})
    tied.head.weight = tied.embed.weight
    # One tensor: one group, split together or not at all.
    assert infer_units(tied) == [{"embed": "embedding_rowwise", "head": "colwise_gather_output"}]
    # A third module reading the same tensor (a second head) might use it any way: all stay whole.
    tied.other = nn.Linear(16, 64, bias=False)
    tied.other.weight = tied.embed.weight
    assert infer_plan(tied) == {}


def test_a_head_whose_bias_its_parent_also_holds_splits_with_its_tied_embedding():
    # BERT's LM head: cls.predictions.bias is the tensor of cls.predictions.decoder.bias; the parent holds it beside the
    # module computing with it, and follows the split.
    model = nn.ModuleDict({"embed": nn.Embedding(64, 16), "predictions": nn.Module()})
    model.predictions.decoder = nn.Linear(16, 64)
    model.predictions.bias = model.predictions.decoder.bias
    model.predictions.decoder.weight = model.embed.weight
    assert infer_units(model) == [{"embed": "embedding_rowwise", "predictions.decoder": "colwise_gather_output"}]
    check_plan(model, resolve_plan(model, infer_plan(model)), 2)
    # A holder beside the head (not above it) is a third reader: refused.
    model.other = nn.Module()
    model.other.bias = model.predictions.decoder.bias
    assert infer_plan(model) == {}
    with pytest.raises(ValueError, match=r"are tied \(one tensor\)"):
        check_plan(model, resolve_plan(model, {"embed": "embedding_rowwise", "predictions.decoder": "colwise_gather_output"}), 2)


def test_other_tables_as_large_as_the_vocabulary_split_over_their_rows_smaller_ones_stay_whole():
    # RoCBert: shape and pronunciation tables beside the token embedding; positions and token types are small.
    model = nn.ModuleDict({"embed": nn.Embedding(64, 16), "shape": nn.Embedding(64, 16), "hashes": nn.Embedding(256, 16),
                           "positions": nn.Embedding(32, 16), "types": nn.Embedding(2, 16), "head": nn.Linear(16, 64, bias=False)})
    model.head.weight = model.embed.weight  # tied: the token embedding among the tables of the head's shape
    units = infer_units(model)
    assert units == [{"embed": "embedding_rowwise", "head": "colwise_gather_output"},
                     {"shape": "embedding_rowwise"}, {"hashes": "embedding_rowwise"}]
    # Without an output head there is no vocabulary to compare with: every table stays whole.
    del model["head"]
    assert infer_units(model) == []


def test_sibling_mlp_beside_adapters_split_on_their_own():
    # X-MOD: the MLP's output module also holds per-language adapters (d -> d/r -> d), run on its whole output.
    layer = EncoderLayer()
    layer.output.adapters = nn.ModuleDict({"en": nn.Module()})
    layer.output.adapters.en.dense1, layer.output.adapters.en.dense2 = nn.Linear(8, 4), nn.Linear(4, 8)
    plan = infer_plan(layer)
    assert plan["intermediate.dense"] == "colwise" and plan["output.dense"] == "rowwise"
    assert plan["output.adapters.en.dense1"] == "colwise" and plan["output.adapters.en.dense2"] == "rowwise"


def test_a_per_head_projection_of_every_heads_values_splits_by_heads_with_its_input_gathered():
    """Doge's dt_proj reads the values (every head), or, shaped alike, a projection may read the attention's input:
    widths alone cannot tell, so it is split by heads and gathers its input only where that arrives as this rank's
    heads (tensor.gathered_input); either way each rank computes its heads' values."""
    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig
    from lightning_parallel.parallelize.tensor.gathered_input import GatherSplitInput

    attention = GatedAttention()
    del attention.gate_proj, attention.g_proj
    attention.dt_proj = nn.Linear(16, 4, bias=False)
    model = nn.ModuleDict({"attn": attention, "mlp": SwiGLU(16, 32)})
    resolved = TensorParallelConfig().resolve(model, warn=lambda _: None, tp_size=2)
    assert resolved.styles["attn.q_proj"] == "colwise" and resolved.styles["attn.dt_proj"] == "colwise_gather_input"
    assert not resolved.kept_whole
    # A whole input passes; one of neither width is refused with the numbers.
    hook = GatherSplitInput("attn.dt_proj", 16, type("Mesh", (), {"size": lambda self: 2})())
    assert hook(attention.dt_proj, (torch.zeros(2, 16),)) is None
    with pytest.raises(RuntimeError, match=r"attn.dt_proj .* got an input of 5 features: neither its whole 16 nor this rank's 8"):
        hook(attention.dt_proj, (torch.zeros(2, 5),))


def test_modernbert_style_output_name_and_chunked_gate_up_projection_are_recognised():
    """ModernBERT: q/k/v with the output projection named ``Wo``; its MLP's ``Wi`` is d→2h, chunked into gate
    and up, then ``Wo`` h→d."""
    attention, mlp = nn.Module(), nn.Module()
    attention.q_proj, attention.k_proj, attention.v_proj = (nn.Linear(16, 16) for _ in range(3))
    attention.Wo = nn.Linear(16, 16)
    mlp.Wi, mlp.Wo = nn.Linear(16, 64), nn.Linear(32, 16)
    assert infer_plan(nn.ModuleDict({"attn": attention, "mlp": mlp})) == {
        "attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise", "attn.Wo": "rowwise",
        "mlp.Wi": "fused_gate_up", "mlp.Wo": "rowwise"}


def test_a_statistic_over_the_split_width_kept_in_a_shaped_parameter_keeps_its_mlp_whole():
    """ConvNeXt-V2's GRN normalises over the MLP's hidden units with gamma/beta shaped [1, 1, 1, h]."""
    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig

    grn = nn.Module()
    grn.gamma, grn.beta = nn.Parameter(torch.zeros(1, 1, 1, 32)), nn.Parameter(torch.zeros(1, 1, 1, 32))
    mlp = nn.Module()
    mlp.pwconv1, mlp.grn, mlp.pwconv2 = nn.Linear(16, 32), grn, nn.Linear(32, 16)
    model = nn.ModuleDict({"mlp": mlp, "other": SwiGLU(16, 32)})
    resolved = TensorParallelConfig().resolve(model, warn=lambda _: None, tp_size=2)
    assert "mlp.pwconv1" not in resolved.styles and "mlp.grn.gamma: its width 32" in resolved.kept_whole["mlp"]


def test_a_column_split_projection_beside_an_in_place_activation_gets_an_output_of_its_own():
    """Swin-V2's position-bias MLP: Linear, ReLU(inplace=True), Linear (a view from DTensor cannot be modified in place)."""
    from lightning_parallel.parallelize.tensor.apply import _beside_in_place

    model = nn.ModuleDict({"cpb": nn.Sequential(nn.Linear(2, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)),
                           "mlp": nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 4))})
    modules = dict(model.named_modules())
    assert _beside_in_place(modules, "cpb.0") and not _beside_in_place(modules, "mlp.0")


class FusedHeadsAttention(nn.Module):
    """Hiera's layout: one fused ``qkv`` (q | k | v blocks) and the heads' output reshaped by ``hidden_size_output``."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.hidden_size_output = heads, dim // heads, dim
        self.qkv = nn.Linear(dim, 3 * dim, dtype=torch.float64)
        self.proj = nn.Linear(dim, dim, dtype=torch.float64)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, L, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = ((q @ k.transpose(-1, -2)) / self.head_dim**0.5).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(B, L, self.hidden_size_output))


def test_a_fused_qkv_width_attribute_is_divided():
    # Hiera's hidden_size_output (one block of its fused qkv) was not divided: "a and b must have same reduction dim"
    # (the coverage sweep's Hiera tp2 cell is exact with it; LocalTensorMode cannot scatter the fused weight here).
    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig

    resolved = TensorParallelConfig().resolve(FusedHeadsAttention(), warn=lambda _: None, tp_size=2)
    assert resolved.styles == {"qkv": "fused_qkv", "proj": "rowwise"}
    assert set(resolved.head_attributes[""]) == {"num_heads", "hidden_size_output"}


class AttentionBlock(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x):
        return x + self.attention(x)


def test_children_called_on_whole_tensors_inside_the_split_train_as_unsplit(simulated_ranks):
    # SegFormer's sequence reduction, called on the attention's whole input after q_proj, had its gradient summed
    # over the ranks although it was whole (2x); a gate from the input multiplied into this rank's heads left the
    # input's gradient a partial sum.
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig, apply_tensor_parallel
    from lightning_parallel.parallelize.tensor.split_region import reduce_split_region_gradients
    from tests.hf_models import ReducedKVAttention

    torch.manual_seed(0)
    module = AttentionBlock(ReducedKVAttention().double())
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    reference = copy.deepcopy(module)
    whole_x = x.detach().clone().requires_grad_()
    expected_out, expected = whole_run(reference, whole_x)
    resolved = TensorParallelConfig().resolve(module, tp_size=2)
    assert resolved.styles["attention.wq"] == "colwise"
    assert not any(name.startswith(("attention.reduce", "attention.gate")) for name in resolved.styles)
    with simulated_ranks():
        apply_tensor_parallel(module, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), resolved)
        out = module(x)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        assert reduce_split_region_gradients(module) > 0
        rank0 = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t)._local_tensors[0]  # noqa: E731
        out, x_grad = rank0(out).detach(), rank0(x.grad)
        grads = {n: rank0(p.grad) for n, p in module.named_parameters()}
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(x_grad, whole_x.grad, rtol=0, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-12, msg=name)


class QueryGateAttention(nn.Module):
    """Gated attention with the query and its per-head output gate in one projection, laid out per head
    (``q_h | gate_h``), beside separate k/v with fewer heads (as MiniCPM5-MoE writes it)."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_gate_proj = nn.Linear(dim, 2 * dim, dtype=torch.float64)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, dtype=torch.float64)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, dtype=torch.float64)
        self.o_proj = nn.Linear(dim, dim, dtype=torch.float64)

    def forward(self, x):
        B, L, _ = x.shape
        q, gate = self.q_gate_proj(x).view(B, L, -1, 2 * self.head_dim).chunk(2, dim=-1)
        k, v = (p(x).view(B, L, -1, self.head_dim).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        groups = q.shape[2] // k.shape[1]  # query heads per key/value head, whatever this rank holds
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q.transpose(1, 2) @ k.transpose(-1, -2) / self.head_dim**0.5).softmax(-1)
        out = (scores @ v).transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(out * gate.reshape(B, L, -1).sigmoid())


def test_a_query_fused_with_its_per_head_gate_splits_with_its_attention(simulated_ranks):
    # MiniCPM5-MoE: q_gate_proj was not taken for a query, so k_proj/v_proj stayed whole and kept the attention whole.
    import copy

    torch.manual_seed(0)
    module, x = QueryGateAttention(), torch.randn(2, 5, 32, dtype=torch.float64)
    assert infer_plan(module) == {"q_gate_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
    expected = whole_run(copy.deepcopy(module), x)
    out, grads, resolved = split_and_run(module, simulated_ranks, x)
    assert set(resolved.head_attributes[""]) == {"num_heads", "num_key_value_heads"}
    torch.testing.assert_close(out, expected[0], rtol=0, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][name], rtol=0, atol=1e-12, msg=name)


class ShortConv(nn.Module):
    """A short-convolution mixer as LFM2/LFM3 write it: d → B|C|x, B·x, depthwise causal convolution, C·(…), → d."""

    def __init__(self, dim: int = 8, kernel: int = 3, bias: bool = True) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 3 * dim, bias=bias, dtype=torch.float64)
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, padding=kernel - 1, bias=bias, dtype=torch.float64)
        self.out_proj = nn.Linear(dim, dim, bias=bias, dtype=torch.float64)

    def forward(self, x):
        B, C, h = self.in_proj(x).transpose(-1, -2).chunk(3, dim=-2)
        if self.conv.bias is None:  # read the weight directly, as transformers' causal_conv1d_fn does
            y = nn.functional.conv1d(B * h, self.conv.weight, None, padding=self.conv.padding, groups=(B * h).shape[1])
        else:
            y = self.conv(B * h)
        return self.out_proj((C * y[..., : x.shape[1]]).transpose(-1, -2))


def _reorder_fused_rows_outside_the_simulation(monkeypatch) -> None:
    """LocalTensorMode turns the index a fused projection's rows are reordered by into a per-rank tensor, and then
    crashes scattering the reordered weight (see test_a_fused_qkv_width_attribute_is_divided): reorder them with the
    simulation paused, as one process does before sharding."""
    from contextlib import nullcontext

    from torch.distributed._local_tensor import local_tensor_mode

    from lightning_parallel.parallelize.tensor import fused

    reorder = fused.rank_major_rows

    def paused(param, layout):
        mode = local_tensor_mode()
        with mode.disable() if mode is not None else nullcontext():
            return reorder(param, layout)

    monkeypatch.setattr(fused, "rank_major_rows", paused)


@pytest.mark.parametrize("bias", [True, False])
def test_a_short_convolution_splits_over_its_channels(simulated_ranks, monkeypatch, bias):
    # LFM3: in_proj (d→B|C|x), its depthwise conv and out_proj stayed whole (tp2 share 0.604).
    import copy

    from torch.distributed.tensor import DTensor

    from lightning_parallel.parallelize.tensor.fused import original_order

    _reorder_fused_rows_outside_the_simulation(monkeypatch)
    torch.manual_seed(0)
    module, x = AttentionBlock(ShortConv(bias=bias)), torch.randn(2, 5, 8, dtype=torch.float64)
    plan = infer_plan(module)
    assert plan == {"attention.in_proj": "fused_blocks", "attention.conv": "channelwise", "attention.out_proj": "rowwise"}
    expected = whole_run(copy.deepcopy(module), x)
    out, grads, resolved = split_and_run(module, simulated_ranks, x)
    assert resolved.fused == {"attention.in_proj": (8, 8, 8)}
    conv = module.attention.conv
    assert (conv.in_channels, conv.out_channels, conv.groups) == (4, 4, 4)
    assert isinstance(conv.weight, DTensor) and conv.weight.placements[0].is_shard(0)
    torch.testing.assert_close(out, expected[0], rtol=0, atol=1e-12)
    for name, grad in grads.items():  # in_proj's gathered rows are rank-major: compared in the module's own order
        torch.testing.assert_close(original_order(module, name, grad), expected[1][name], rtol=0, atol=1e-12, msg=name)


class PointwiseAfterConv(nn.Module):
    """A depthwise convolution *before* d→h→d projections (ConvNeXt's block without its norm): not a short convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.dwconv = nn.Conv1d(8, 8, 3, groups=8, padding=1)
        self.pwconv1, self.pwconv2 = nn.Linear(8, 32), nn.Linear(32, 8)


def test_depthwise_convolutions_split_only_between_their_projections():
    # Its projections are an MLP after the convolution, which runs on the whole input: the convolution stays whole.
    assert infer_plan(PointwiseAfterConv()) == {"pwconv1": "colwise", "pwconv2": "rowwise"}
    module = ShortConv()
    module.conv = nn.Conv1d(8, 8, 3, groups=2)  # mixes the channels of a group: cannot run on a rank's channels
    assert infer_plan(module) == {}
    with pytest.raises(TypeError, match=r"conv: style 'channelwise' splits a depthwise convolution .* got Conv1d \(groups=2"):
        check_plan(module, resolve_plan(module, {"in_proj": "fused_blocks", "conv": "channelwise", "out_proj": "rowwise"}), 2)
    module = ShortConv()
    with pytest.raises(ValueError, match=r"conv: style 'channelwise' .* found no column-wise projection of that width"):
        check_plan(module, resolve_plan(module, {"conv": "channelwise", "out_proj": "rowwise"}), 2)
    with pytest.raises(ValueError, match=r"in_proj: style 'fused_blocks' cuts its 24 output features .* found no row-wise"):
        resolve_plan(module, {"in_proj": "fused_blocks"})
    with pytest.raises(ValueError, match=r"conv.groups=8 \(its channels\) is not divisible by tensor_parallel_size=3"):
        check_plan(module, resolve_plan(module, infer_plan(module)), 3)


class Trunk(nn.Module):
    """Blocks in an ``nn.ModuleList``, as sequence parallelism looks for them."""

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class HeadNormAttention(nn.Module):
    """Qwen3's attention, reduced: 4 heads of width 4, an RMSNorm over each query and key head."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = 4, 4
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(16, 16, dtype=torch.float64) for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(4, dtype=torch.float64), nn.RMSNorm(4, dtype=torch.float64)

    def forward(self, x):
        B, L, _ = x.shape
        q, k = (norm(p(x).view(B, L, -1, self.head_dim)) for norm, p in ((self.q_norm, self.q_proj), (self.k_norm, self.k_proj)))
        v = self.v_proj(x).view(B, L, -1, self.head_dim)
        return self.o_proj((q * k + v).reshape(B, L, -1))


class PreNormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attention = nn.RMSNorm(16, dtype=torch.float64), HeadNormAttention()

    def forward(self, x):
        return x + self.attention(self.norm(x))


def test_per_head_norm_gradients_under_sequence_parallelism_are_summed_once(simulated_ranks):
    # Qwen3, Gemma3, LFM2 under tp2 with sequence_parallel=True: the per-head q_norm, a SequenceParallel module
    # (its gradient summed by DTensor), was summed again as a split-region parameter: its gradient 2x.
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig, apply_tensor_parallel
    from lightning_parallel.parallelize.tensor.split_region import reduce_split_region_gradients

    torch.manual_seed(0)
    module, x = Trunk(PreNormBlock(), PreNormBlock()), torch.randn(2, 6, 16, dtype=torch.float64)
    expected_out, expected = whole_run(copy.deepcopy(module), x)
    resolved = TensorParallelConfig(sequence_parallel=True).resolve(module, tp_size=2)
    with simulated_ranks():
        apply_tensor_parallel(module, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), resolved, sequence_parallel=True)
        out = module(x)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        reduce_split_region_gradients(module)
        rank0 = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t)._local_tensors[0]  # noqa: E731
        out, grads = rank0(out).detach(), {n: rank0(p.grad) for n, p in module.named_parameters()}
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-12, msg=name)


class _SparseActivationMLP(nn.Module):
    """A gated MLP keeping only the gate activations above mean + 1.6·std over its hidden units (Gemma-3n's
    activation sparsity), written as a user would: the statistic is in forward, no module shows it."""

    def __init__(self, width: int, hidden: int, sparse: bool = True) -> None:
        super().__init__()
        self.sparse = sparse
        self.gate_proj, self.up_proj = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.sparse:
            cutoff = gate.mean(-1, keepdim=True) + 1.6 * gate.std(-1, keepdim=True, unbiased=False)
            gate = torch.relu(gate - cutoff)
        return self.down_proj(torch.nn.functional.gelu(gate) * self.up_proj(x))


class _NormAfterTheSum(nn.Module):
    """A low-rank residual (Gemma-3n's LAuReL): d→r, r→d, then a norm of the all-reduced output: splits exactly."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.linear_left, self.linear_right = nn.Linear(width, rank, bias=False), nn.Linear(rank, width, bias=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.linear_right(self.linear_left(x)))


def test_an_mlp_combining_its_hidden_units_before_the_down_projection_splits_with_outputs_gathered():
    """Run once on random weights, whole and as the sum of the ranks' slices: the sparse MLP differs (a rank's mean and
    deviation are its slice's) and splits with every output gathered whole (tensor.gathered_outputs; it stayed whole
    before); the dense one and a norm after the row-wise sum split column/row-wise."""
    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig

    model = nn.ModuleDict({"sparse": _SparseActivationMLP(16, 64), "dense": _SparseActivationMLP(16, 64, sparse=False),
                           "laurel": _NormAfterTheSum(16, 8)})
    resolved = TensorParallelConfig().resolve(model, warn=lambda _: None, tp_size=2)
    assert {resolved.styles[f"sparse.{n}"] for n in ("gate_proj", "up_proj", "down_proj")} == {"colwise_gather_output"}
    assert "sparse" not in resolved.kept_whole
    assert resolved.styles["dense.gate_proj"] == "colwise" and resolved.styles["dense.down_proj"] == "rowwise"
    assert resolved.styles["laurel.linear_right"] == "rowwise" and "laurel" not in resolved.kept_whole
    explicit = {"sparse.gate_proj": "colwise", "sparse.up_proj": "colwise", "sparse.down_proj": "rowwise"}
    with pytest.raises(ValueError, match="sparse .*differs from the whole MLP"):
        check_plan(model, resolve_plan(model, explicit), 2)


def test_the_token_embedding_tied_to_the_head_splits_beside_another_embedding_of_its_shape():
    """Gemma 4 keeps a per-layer input embedding beside its token embedding; where both are [vocabulary, width], the one
    whose weight is the head's is the token embedding (an untied head beside two such embeddings stays ambiguous)."""
    model = nn.Module()
    model.embed_tokens, model.embed_per_layer = nn.Embedding(64, 16), nn.Embedding(64, 16)
    model.mlp = SwiGLU(16, 32)
    model.lm_head = nn.Linear(16, 64, bias=False)
    model.lm_head.weight = model.embed_tokens.weight
    plan = infer_plan(model)
    assert plan["embed_tokens"] == "embedding_rowwise" and plan["lm_head"] == "colwise_gather_output"
    # The other table, as large as the vocabulary, splits over its rows on its own (not as the head's pair).
    assert {"embed_tokens", "lm_head"} in [set(unit) for unit in infer_units(model)]
    assert plan["embed_per_layer"] == "embedding_rowwise"
    model.lm_head.weight = nn.Parameter(torch.zeros(64, 16))
    plan = infer_plan(model)
    # Untied: which embedding is the head's pair is ambiguous, the head stays whole; the tables split on their own.
    assert "lm_head" not in plan and plan["embed_tokens"] == plan["embed_per_layer"] == "embedding_rowwise"


class _ReadsItsTokenTable(nn.Module):
    """A tied LM that blends each position with the pad token's row read straight from the table, as Gemma 4 blanks
    its multimodal positions (``embed_tokens.weight[pad_id]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 16)
        self.mlp = SwiGLU(16, 32)
        self.lm_head = nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(tokens) + 0.5 * self.embed_tokens.weight[0].view(1, 1, -1)
        return self.lm_head(hidden + self.mlp.w2(torch.nn.functional.silu(self.mlp.w1(hidden)) * self.mlp.w3(hidden)))


def test_a_model_reading_its_split_token_table_gets_the_whole_table_and_trains_as_one_device(simulated_ranks):
    torch.manual_seed(0)
    model = _ReadsItsTokenTable().double()
    tokens = torch.randint(0, 64, (2, 5))
    reference = _ReadsItsTokenTable().double()
    reference.load_state_dict(model.state_dict())
    expected_out, expected_grads = whole_run(reference, tokens)
    out, grads, resolved = split_and_run(model, simulated_ranks, tokens)
    assert resolved.styles["embed_tokens"] == "embedding_rowwise"
    torch.testing.assert_close(out, expected_out)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


class MultiHeadNorm(nn.Module):
    """Normalises each head alone and scales ``heads·head_dim`` features (xLSTM's multi-head norm)."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))


class MatrixMemoryAttention(nn.Module):
    """q/k/v/out_proj with a per-head gate and a per-head child norm (xLSTM's mLSTM layer's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.qk_dim, self.v_dim = 4, 8, 16
        self.q, self.k, self.v = nn.Linear(16, 8, bias=False), nn.Linear(16, 8, bias=False), nn.Linear(16, 16, bias=False)
        self.igate_preact = nn.Linear(16, 4)
        self.multihead_norm = MultiHeadNorm(4, 4)
        self.out_proj = nn.Linear(16, 16, bias=False)


def test_a_child_working_head_by_head_is_sharded_with_the_heads():
    model = nn.ModuleDict({"attn": MatrixMemoryAttention()})
    plan = infer_plan(model)
    assert plan == {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.igate_preact": "colwise",
                    "attn.out_proj": "rowwise"}
    resolved = resolve_plan(model, plan)
    assert resolved.per_head["attn.multihead_norm"] == ("weight",)
    assert resolved.head_attributes["attn.multihead_norm"] == ("num_heads",)
    assert {"num_heads", "qk_dim", "v_dim"} <= set(resolved.head_attributes["attn"])
    check_plan(model, resolved, 2)  # the norm's width is no longer a norm over every head: nothing refused


class ChainedMLP(nn.Module):
    """Zaya's router MLP: norm, fc1 (d→d), fc2 (d→d), then a read-out to fewer features."""

    def __init__(self, width: int = 16, classes: int = 5, swapped: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)
        self.out_proj = nn.Linear(width, classes, bias=False)
        self.swapped = swapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.fc2, self.fc1) if self.swapped else (self.fc1, self.fc2)
        return self.out_proj(torch.nn.functional.gelu(second(torch.nn.functional.gelu(first(self.norm(x))))))


def test_chained_square_projections_split_as_an_mlp_with_the_read_out_whole():
    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig

    resolved = TensorParallelConfig().resolve(nn.ModuleDict({"router": ChainedMLP()}), warn=lambda _: None, tp_size=2)
    assert {k: v for k, v in resolved.styles.items() if v != "replicate"} == {"router.fc1": "colwise", "router.fc2": "rowwise"}
    # Called in the other order than registered: the probe's run differs, the chain splits with its outputs gathered
    # whole (tensor.gathered_outputs: exact whatever the order; it stayed whole before).
    swapped = TensorParallelConfig().resolve(
        nn.ModuleDict({"router": ChainedMLP(swapped=True), "mlp": SwiGLU(16, 32)}), warn=lambda _: None, tp_size=2)
    assert {k: v for k, v in swapped.styles.items() if k.startswith("router.")} == {
        "router.fc1": "colwise_gather_output", "router.fc2": "colwise_gather_output", "router.out_proj": "replicate"}
    assert "router" not in swapped.kept_whole


class SharedBlockModel(nn.Module):
    """Zamba's layout: one block's weights held by a module at each of several depths (tied tensors)."""

    def __init__(self, adapter: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.depths = nn.ModuleList([LlamaishBlock() for _ in range(2)])
        for name, param in self.depths[0].named_parameters():
            owner, _, pname = name.rpartition(".")
            self.depths[1].get_submodule(owner).register_parameter(pname, param)
        if adapter:  # Zamba2's per-depth adapter added to the shared gate projection's whole output
            for depth in self.depths:
                depth.feed_forward.adapters = nn.ModuleList([nn.Sequential(nn.Linear(16, 4, bias=False), nn.Linear(4, 48, bias=False))])


def test_a_block_tied_across_depths_is_split_once_for_all_its_uses():
    from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig

    resolved = TensorParallelConfig().resolve(SharedBlockModel(), warn=lambda _: None, tp_size=2)
    assert resolved.styles["depths.0.attention.wq"] == resolved.styles["depths.1.attention.wq"] == "colwise"
    assert resolved.styles["depths.0.feed_forward.w2"] == resolved.styles["depths.1.feed_forward.w2"] == "rowwise"
    # An adapter of the MLP's input writing the split projection's width beside it: its last projection split the
    # same way at every depth, the one before it replicated (tensor.adapters; exactness in test_tensor_side_paths).
    adapted = TensorParallelConfig().resolve(SharedBlockModel(adapter=True), warn=lambda _: None, tp_size=2)
    for depth in range(2):
        assert adapted.styles[f"depths.{depth}.feed_forward.w1"] == "colwise"
        assert adapted.styles[f"depths.{depth}.feed_forward.adapters.0.1"] == "colwise"
        assert adapted.styles[f"depths.{depth}.feed_forward.adapters.0.0"] == "replicate"
    assert not adapted.kept_whole


class BlockDiagonalRecurrence(nn.Module):
    """Per-channel decay and block-diagonal gates over ``heads`` blocks (RecurrentGemma's RG-LRU)."""

    def __init__(self, heads: int, width: int) -> None:
        super().__init__()
        self.num_attention_heads, self.block_width = heads, width
        self.recurrent_param = nn.Parameter(torch.zeros(heads * width))
        self.input_gate_weight = nn.Parameter(torch.zeros(heads, width, width))
        self.input_gate_bias = nn.Parameter(torch.zeros(heads, width))


class GatedRecurrenceBlock(nn.Module):
    """Two d→w branches, a depthwise convolution and a blockwise recurrence, w→d out (Griffin's recurrent block)."""

    def __init__(self) -> None:
        super().__init__()
        self.lru_width = 16
        self.linear_y, self.linear_x, self.linear_out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.conv_1d = nn.Conv1d(16, 16, kernel_size=4, groups=16, padding=3)
        self.rg_lru = BlockDiagonalRecurrence(4, 4)


def test_a_gated_recurrence_block_is_split_over_its_channels_and_blocks():
    model = nn.ModuleDict({"block": GatedRecurrenceBlock()})
    plan = infer_plan(model)
    assert plan == {"block.linear_y": "colwise", "block.linear_x": "colwise", "block.conv_1d": "channelwise",
                    "block.linear_out": "rowwise"}
    resolved = resolve_plan(model, plan)
    assert resolved.per_head["block.rg_lru"] == ("recurrent_param", "input_gate_weight", "input_gate_bias")
    assert resolved.head_attributes["block.rg_lru"] == ("num_attention_heads",)
    assert resolved.head_attributes["block"] == ("lru_width",)
    check_plan(model, resolved, 2)
    # A child that mixes the blocks (a full matrix over the channels) is no blockwise recurrence: left whole.
    model.block.rg_lru.input_gate_weight = nn.Parameter(torch.zeros(16, 16))
    assert infer_plan(model) == {}
