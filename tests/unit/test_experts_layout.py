"""Grouped experts (transformers' fused 3-D MoE layout) recognised for the tensor-parallel plan."""

import pytest
import torch
from torch import nn

from lightning_parallel.parallelize.tensor.experts import DOWN, ExpertsLayout, check_experts, experts_layout
from lightning_parallel.parallelize.tensor.inference import infer_plan


class Experts(nn.Module):
    """Hand-written 3-D experts: ``[E, 2I, H]`` / ``[E, H, I]`` unless ``transposed``."""

    def __init__(self, experts=4, hidden=8, inner=6, transposed=False, gated=True, **attributes):
        super().__init__()
        up = "gate_up_proj" if gated else "up_proj"
        width = (2 if gated else 1) * inner
        shape_up, shape_down = ((experts, hidden, width), (experts, inner, hidden)) if transposed else (
            (experts, width, hidden), (experts, hidden, inner))
        self.register_parameter(up, nn.Parameter(torch.zeros(shape_up)))
        self.register_parameter(DOWN, nn.Parameter(torch.zeros(shape_down)))
        for name, value in attributes.items():
            setattr(self, name, value)


def test_recorded_layouts_are_read_from_the_module():
    layout = experts_layout(Experts(is_transposed=False, is_concatenated=True, has_gate=True))
    assert layout == ExpertsLayout("gate_up_proj", True, False, True, 4, 6)
    assert layout.split_dims() == {"gate_up_proj": 1, DOWN: 2} and layout.fused_blocks() == (6, 6)
    flipped = experts_layout(Experts(transposed=True, is_transposed=True, is_concatenated=False, has_gate=True))
    assert (flipped.transposed, flipped.concatenated, flipped.fused_blocks()) == (True, False, None)
    assert flipped.split_dims() == {"gate_up_proj": 2, DOWN: 1}


def test_transposition_is_inferred_from_shapes_where_they_tell():
    layout = experts_layout(Experts(transposed=True, is_concatenated=True))
    assert (layout.transposed, layout.intermediate, layout.split_dims()) == (True, 6, {"gate_up_proj": 2, DOWN: 1})
    # Ungated [E, a, b] / [E, b, a] fits both storages: only the module's own record decides.
    assert "is_transposed" in experts_layout(Experts(transposed=True, gated=False))
    layout = experts_layout(Experts(transposed=True, gated=False, is_transposed=True))
    assert (layout.up, layout.gated, layout.transposed, layout.intermediate) == ("up_proj", False, True, 6)


def test_unrecorded_gate_up_order_outside_transformers_is_not_guessed():
    reason = experts_layout(Experts(is_transposed=False))
    assert isinstance(reason, str) and "is_concatenated" in reason
    with pytest.raises(ValueError, match="cannot be split over tensor-parallel ranks.*is_concatenated"):
        check_experts("moe.experts", Experts(is_transposed=False), 2)


def test_experts_refused_where_the_split_would_change_the_math():
    norm = Experts(is_transposed=False, is_concatenated=True, has_post_expert_norm=True)
    assert "post_expert_norm" in experts_layout(norm)
    extra = Experts(is_transposed=False, is_concatenated=True)
    extra.scale = nn.Parameter(torch.ones(4))
    assert "scale" in experts_layout(extra)
    nested = Experts(is_transposed=False, is_concatenated=True)
    nested.post_expert_norm = nn.Module()
    nested.post_expert_norm.weight = nn.Parameter(torch.ones(4, 8))  # Ergo: applied to each expert's whole output
    assert "post_expert_norm.weight" in experts_layout(nested)
    with pytest.raises(ValueError, match="6 hidden units are not divisible by tensor_parallel_size=4"):
        check_experts("moe.experts", Experts(is_transposed=False, is_concatenated=True), 4)
    with pytest.raises(TypeError, match="style 'experts' needs a module holding grouped experts"):
        check_experts("moe.gate", nn.Linear(8, 4), 2)


def test_auto_plan_splits_a_transformers_mixtrals_experts():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )
    plan = infer_plan(transformers.MixtralForCausalLM(config))
    assert plan["model.layers.0.mlp.experts"] == "experts"
    assert plan["model.layers.0.self_attn.q_proj"] == "colwise"


class ExpertLinears(nn.Module):
    """A batch of per-expert linear maps (JetMoE's ``ParallelExperts``): tokens sorted by expert, and their counts."""

    def __init__(self, experts: int, d_in: int, d_out: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.weight = nn.Parameter(torch.randn(experts, d_out, d_in) * 0.3)

    def forward(self, inputs, counts):
        return torch.cat([nn.functional.linear(x, self.weight[i]) for i, x in enumerate(inputs.split(counts))])


class PairMoE(nn.Module):
    """Top-1 routing over two expert projections, gated (``gate | up``); ``combine`` mixes the hidden units."""

    def __init__(self, experts=4, hidden=8, inner=6, combine=False) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.input_linear, self.output_linear = ExpertLinears(experts, hidden, 2 * inner), ExpertLinears(experts, inner, hidden)
        self.bias, self.combine = nn.Parameter(torch.zeros(hidden)), combine

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        gates = self.router(flat).softmax(-1)
        weight, expert = gates.max(-1)
        order = expert.argsort()
        counts = torch.bincount(expert, minlength=self.router.out_features).tolist()
        gate, up = self.input_linear(flat[order], counts).chunk(2, dim=-1)
        hidden = nn.functional.silu(gate) * up
        if self.combine:  # a statistic over every hidden unit: a rank's slice cannot compute it
            hidden = hidden / hidden.norm(dim=-1, keepdim=True)
        out = torch.zeros_like(flat).index_add(0, order, self.output_linear(hidden, counts) * weight[order, None])
        return out.view_as(x) + self.bias


def test_expert_projection_pairs_are_split_where_the_block_runs_them_as_one_mlp_per_expert():
    from lightning_parallel.parallelize.tensor.expert_projections import ProjectionPairLayout

    layout = experts_layout(PairMoE())
    assert layout == ProjectionPairLayout("input_linear", "output_linear", True, 4, 6) and layout.blocks() == (6, 6)
    assert infer_plan(nn.ModuleDict({"moe": PairMoE()})) == {"moe": "experts"}
    with pytest.raises(ValueError, match=r"moe: each expert's 6 hidden units are not divisible by tensor_parallel_size=4"):
        check_experts("moe", PairMoE(), 4)
    # Its forward combines the hidden units: run whole and split, they differ: left whole with the reason.
    assert "do not run as one MLP per expert" in experts_layout(PairMoE(combine=True))

    class Attention(PairMoE):  # the pair around an attention (JetMoE's MoA): no forward on its hidden states alone
        def forward(self, x, keys):
            return super().forward(x) + keys

    assert "could not be checked" in experts_layout(Attention())


class FlatGLU(nn.Module):  # DBRX's DbrxExpertGLU: every expert's rows stacked, [E·I, H]
    def __init__(self, experts=4, hidden=8, inner=6) -> None:
        super().__init__()
        self.moe_num_experts, self.ffn_hidden_size = experts, inner
        self.w1, self.v1, self.w2 = (nn.Parameter(torch.randn(experts * inner, hidden) * 0.3) for _ in range(3))


class FlatExperts(nn.Module):  # DBRX's DbrxExperts: views the rows per expert by its own ffn_hidden_size
    def __init__(self, experts=4, hidden=8, inner=6, combine=False) -> None:
        super().__init__()
        self.mlp, self.num_experts, self.ffn_hidden_size, self.combine = FlatGLU(experts, hidden, inner), experts, inner, combine

    def forward(self, x, expert, weight):
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows = (expert == e).nonzero().flatten()
            w1, v1, w2 = (p.view(-1, self.ffn_hidden_size, x.shape[-1])[e] for p in (self.mlp.w1, self.mlp.v1, self.mlp.w2))
            hidden = nn.functional.silu(x[rows] @ w1.T) * (x[rows] @ v1.T)
            if self.combine:
                hidden = hidden.softmax(-1)  # over every hidden unit: a rank's slice cannot compute it
            out = out.index_add(0, rows, (hidden @ w2) * weight[rows, None])
        return out


class FlatBlock(nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.router, self.experts = nn.Linear(8, 4, bias=False), FlatExperts(**kwargs)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weight, expert = self.router(flat).softmax(-1).max(-1)
        return self.experts(flat, expert, weight).view_as(x)


def test_flat_experts_viewed_per_expert_are_split_per_hidden_unit_where_the_block_agrees():
    from lightning_parallel.parallelize.tensor.flat_experts import FlatExpertsLayout

    layout = experts_layout(FlatBlock())
    assert layout == FlatExpertsLayout("experts", ("mlp.w1", "mlp.v1", "mlp.w2"),
                                       (("", "ffn_hidden_size"), ("mlp", "ffn_hidden_size")), 4, 6)
    # The block is split, not also the experts module inside it (its forward needs the routing: it would be refused).
    assert infer_plan(nn.ModuleDict({"ffn": FlatBlock()}), warn=pytest.fail) == {"ffn": "experts"}
    with pytest.raises(ValueError, match=r"ffn: each expert's 6 hidden units are not divisible by tensor_parallel_size=4"):
        check_experts("ffn", FlatBlock(), 4)
    assert "do not split per hidden unit" in experts_layout(FlatBlock(combine=True))
