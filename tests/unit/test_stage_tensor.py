"""Tensor parallelism inside traced pipeline stages, in one process: a model is traced and cut into two
stages, each stage's parameters are placed on a 2-rank ``tp`` mesh by the auto plan, and the stages run in
sequence on DTensors (two ranks simulated with torch's ``LocalTensorMode`` over the ``fake`` backend). The
outputs and every parameter's gradient must equal the whole model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_parallel.parallelize.pipeline.build import _named_tensors, _set_by_name, _trace
from lightning_parallel.parallelize.pipeline.stage_tensor import StageTensorParallel
from lightning_parallel.parallelize.pipeline.stage_views import contiguous_before_views, contiguous_local
from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig

aten = torch.ops.aten


def run_split_over_tp(module: nn.Module, tokens: torch.Tensor, split_point: str, simulated_ranks) -> tuple:
    """The traced stages of ``module`` on 2 simulated tp ranks: (output, whole gradient of each parameter, placement
    of each parameter)."""
    resolved = TensorParallelConfig().resolve(module, tp_size=2)
    pipe = _trace(module, (tokens,), {}, [split_point], training=True)
    originals = dict(_named_tensors(module))
    with simulated_ranks():
        tp = StageTensorParallel.from_plan(resolved, "", init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        placed: dict[str, nn.Parameter] = {}
        for s in range(pipe.num_stages):
            stage = pipe.get_stage_module(s)
            for name, tensor in list(_named_tensors(stage)):
                if isinstance(tensor, nn.Parameter) and name in originals:
                    placed.setdefault(name, tp.distribute(name, tensor))
                    _set_by_name(stage, name, placed[name])
            tp.wrap(stage)
        assert any(p.placements[0].is_shard() for p in placed.values()), "the plan split nothing"
        with tp.context():
            # The split module's graph calls the stages in order (pipe() would detach between them).
            output = torch.fx.Interpreter(pipe.split_gm).run(tokens)
            output = output[0] if isinstance(output, (tuple, list)) else output
            (output * torch.linspace(-1, 1, output.shape[-1], dtype=output.dtype)).sum().backward()
            missing = [name for name, p in placed.items() if p.grad is None]
            assert not missing, missing
            grads = {name: p.grad.full_tensor() for name, p in placed.items()}
    return output, grads, {name: p.placements[0] for name, p in placed.items()}


def whole_model(module: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    output = module(tokens)
    (output * torch.linspace(-1, 1, output.shape[-1], dtype=output.dtype)).sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad()
    return output.detach(), grads


def assert_same(split: tuple[torch.Tensor, dict], whole: tuple[torch.Tensor, dict], atol: float) -> None:
    torch.testing.assert_close(split[0], whole[0], rtol=0, atol=atol)
    assert split[1].keys() <= whole[1].keys() and len(split[1]) == len(whole[1])
    for name, grad in split[1].items():
        torch.testing.assert_close(grad, whole[1][name], rtol=0, atol=atol, msg=name)


def test_hand_written_llama_heads_merged_with_reshape(simulated_ranks):
    # Issue 29 item 4: `o.transpose(1, 2).reshape(B, L, -1)` was traced as a view that the local shards'
    # layout does not allow ("view size is not compatible with input tensor's size and stride").
    from tests.hf_models import ReferenceLlamaLM

    torch.manual_seed(0)
    model = ReferenceLlamaLM().double()
    tokens = torch.randint(0, 128, (2, 8))
    whole = whole_model(model, tokens)
    assert_same(run_split_over_tp(model, tokens, "layers.2", simulated_ranks), whole, atol=1e-12)


def test_transformers_llama_with_default_sdpa_attention(simulated_ranks):
    # transformers' SDPA passes a [B, 1, L, S] mask as attn_mask: DTensor had no rule placing it (and then
    # the heads were merged by a view, as above). transformers computes rotary tables and norms in float32.
    pytest.importorskip("transformers")
    from tests.hf_models import HFCausalLM

    torch.manual_seed(0)
    model = HFCausalLM("llama", attention="sdpa").double()
    tokens = torch.randint(0, 128, (2, 8))
    whole = whole_model(model, tokens)
    assert_same(run_split_over_tp(model, tokens, "net.model.layers.2", simulated_ranks), whole, atol=1e-5)


class ShortConv(nn.Module):
    """LFM2's short-convolution mixer, written out: in_proj d→3d (B | C | x), a causal depthwise convolution, out_proj."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(width, 3 * width, bias=False)
        self.conv = nn.Conv1d(width, width, kernel_size=3, groups=width, padding=2)
        self.out_proj = nn.Linear(width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, c, x = self.in_proj(hidden).transpose(-1, -2).chunk(3, dim=-2)
        y = c * self.conv(b * x)[..., : hidden.shape[1]]
        return self.out_proj(y.transpose(-1, -2))


class ShortConvLM(nn.Module):
    def __init__(self, width: int = 16, layers: int = 4, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.layers = nn.ModuleList(ShortConv(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for norm, layer in zip(self.norms, self.layers):
            hidden = hidden + layer(norm(hidden))
        return self.head(hidden)


def assert_short_convolutions_split(placements: dict, prefix: str) -> None:
    """Every short convolution's in_proj (fused_blocks) and depthwise convolution (channelwise) hold half the channels."""
    split = {name: placement for name, placement in placements.items() if name.startswith(prefix)}
    for name in ("in_proj.weight", "conv.weight", "out_proj.weight"):
        found = {key: value for key, value in split.items() if key.endswith(f".{name}")}
        assert found, name
        expected = Shard(1) if name == "out_proj.weight" else Shard(0)
        assert set(found.values()) == {expected}, found


def test_short_convolution_split_over_its_channels_inside_stages(simulated_ranks):
    # fused_blocks and channelwise were not placed inside stages (the mixer stayed replicated but for out_proj); the
    # depthwise convolution of a rank's channels has no DTensor rule and runs locally with groups / tp.
    torch.manual_seed(0)
    model = ShortConvLM().double()
    assert TensorParallelConfig().resolve(model, tp_size=2).styles["layers.0.conv"] == "channelwise"
    tokens = torch.randint(0, 32, (2, 8))
    whole = whole_model(model, tokens)
    split = run_split_over_tp(model, tokens, "layers.2", simulated_ranks)
    assert_same(split, whole, atol=1e-12)
    assert_short_convolutions_split(split[2], "layers.")
    assert split[2]["layers.0.conv.bias"] == Shard(0)


def test_transformers_lfm2_short_convolutions_inside_stages(simulated_ranks):
    # LFM2's ShortConv hands conv.weight to F.conv1d itself and, with a cache built in training (use_cache), copies
    # its input's last positions into a fresh conv state nobody reads: a DTensor written into a plain tensor, which
    # failed with a bare AssertionError in DTensor's dispatch before those writes were dropped from the stages.
    # transformers computes norms and rotary tables in float32.
    pytest.importorskip("transformers")
    from tests.hf_models import HFOtherLM

    torch.manual_seed(0)
    model = HFOtherLM("lfm2").double()
    assert model.net.config.layer_types[:2] == ["conv", "full_attention"]
    tokens = torch.randint(0, 128, (2, 8))
    whole = whole_model(model, tokens)
    split = run_split_over_tp(model, tokens, "net.model.layers.2", simulated_ranks)
    assert_same(split, whole, atol=1e-5)
    assert_short_convolutions_split(split[2], "net.model.layers.")


def test_a_view_is_made_contiguous_only_where_the_local_tensor_needs_it(simulated_ranks):
    with simulated_ranks():
        mesh = init_device_mesh("cpu", (2,))
        base = torch.randn(2, 4, 8, 3, dtype=torch.float64, requires_grad=True)
        # Split over dim 1 out of a replicated tensor: each rank's part is a contiguous copy, so its
        # transpose (heads merged back, as attention does) is not.
        sharded = distribute_tensor(base.detach(), mesh, [Replicate()]).requires_grad_()
        heads = sharded.redistribute(placements=[Shard(1)]).transpose(1, 2)
        assert not heads.to_local().is_contiguous()
        fixed = contiguous_local(heads)
        assert fixed.to_local().is_contiguous() and fixed.placements == heads.placements
        merged = fixed.reshape(2, 8, 12)
        torch.testing.assert_close(merged.full_tensor(), base.detach().transpose(1, 2).reshape(2, 8, 12))
        merged.sum().backward()
        assert isinstance(sharded.grad, DTensor)
        torch.testing.assert_close(sharded.grad.full_tensor(), torch.ones_like(base))
        already = distribute_tensor(base.detach(), mesh, [Shard(0)])
        assert contiguous_local(already) is already


def test_writes_into_a_fresh_tensor_nothing_reads_are_dropped():
    from lightning_parallel.parallelize.pipeline.graph import clean_graph
    from torch.export.unflatten import InterpreterModule

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    state = graph.call_function(aten.zeros.default, ([2, 3],))  # a cache's state, written and never read
    graph.call_function(aten.copy_.default, (graph.call_function(aten.slice.Tensor, (state, 1, 0, 2)), x))
    read = graph.call_function(aten.zeros.default, ([2, 2],))  # written, then read: kept
    graph.call_function(aten.add_.Tensor, (read, x))
    graph.output(graph.call_function(aten.mul.Tensor, (read, 2)))
    module = InterpreterModule(graph)
    clean_graph(module, None)
    targets = [node.target for node in module.graph.nodes if node.op == "call_function"]
    assert targets == [aten.zeros.default, aten.add_.Tensor, aten.mul.Tensor]
    x_value = torch.ones(2, 2)
    torch.testing.assert_close(module(x_value), 2 * x_value)


def test_views_of_tensors_written_in_place_stay_views():
    from torch.export.unflatten import InterpreterModule

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(aten.mul.Tensor, (x, 2))
    graph.call_function(aten.add_.Tensor, (graph.call_function(aten.view.default, (y, [-1])), 1))  # y.view(-1).add_(1)
    of_written = graph.call_function(aten.reshape.default, (y, [-1]))  # must see the write: stays a view of y
    of_input = graph.call_function(aten.view.default, (x, [-1]))
    graph.output(graph.call_function(aten.add.Tensor, (of_written, of_input)))
    module = nn.Module()
    module.inner = InterpreterModule(graph)
    contiguous_before_views(module)
    assert of_written.args[0] is y
    assert of_input.args[0].target is contiguous_local and of_input.args[0].args == (x,)
    x_value = torch.arange(4.0)
    torch.testing.assert_close(module.inner(x_value), x_value * 2 + 1 + x_value)


class TiedLM(nn.Module):
    """A lookup (with a padding row) in a table the head reads again, around MLP blocks."""

    def __init__(self, width: int = 16, layers: int = 4, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=3)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                                  nn.Linear(2 * width, width)) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return self.head(hidden)


def test_a_stages_lookup_computes_the_gradient_of_its_own_rows(simulated_ranks, monkeypatch):
    """A traced stage's lookup in a vocabulary-split table runs the split backward (each rank's rows of the gradient,
    not DTensor's whole table on every rank), and the gradients stay the whole model's, padding row and tied head
    included."""
    from lightning_parallel.parallelize.tensor import vocabulary

    rows = []
    backward = vocabulary._SplitLookup.backward

    def counted(ctx, grad_output):
        rows.append(ctx.rows)
        return backward(ctx, grad_output)

    monkeypatch.setattr(vocabulary._SplitLookup, "backward", staticmethod(counted))
    torch.manual_seed(0)
    model = TiedLM().double()
    tokens = torch.randint(0, 32, (2, 8))
    tokens[0, :3] = 3  # the padding row, looked up
    whole = whole_model(model, tokens)
    split = run_split_over_tp(model, tokens, "layers.2", simulated_ranks)
    assert split[2]["embed.weight"] == Shard(0)
    assert rows and set(rows) == {16}, rows  # half of the 32 rows
    output, grads, _ = split
    torch.testing.assert_close(output, whole[0], rtol=0, atol=1e-12)
    # The stages hold the tied table under both names (the pipeline sums their gradients): together, the whole's.
    torch.testing.assert_close(grads.pop("embed.weight") + grads.pop("head.weight"), whole[1].pop("embed.weight"), rtol=0, atol=1e-12)
    assert grads.keys() == whole[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, whole[1][name], rtol=0, atol=1e-12, msg=name)
