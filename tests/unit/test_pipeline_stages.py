"""What traced pipeline stages send and run, and which BatchNorm pipelines are refused, checked in-process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from lightning_parallel.parallelize.data.batchnorm import batch_statistics_layers, check_pipeline_batch_statistics
from lightning_parallel.parallelize.pipeline.build import _trace
from lightning_parallel.parallelize.pipeline.stage_boundary import contiguous_boundaries

B, L, D = 2, 3, 4


class TransposingBlock(nn.Module):
    """Mixes positions through a transpose: its output, and the gradient of its input, are not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(L, L, dtype=torch.float64))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, (h.transpose(1, 2) @ self.mix).transpose(1, 2), 0.0)


class MaskedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D, dtype=torch.float64)
        self.layers = nn.ModuleList(TransposingBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        mask = (x.sum(-1, keepdim=True) > -100).expand(-1, -1, D)  # stride 0, as attention masks are built
        for layer in self.layers:
            h = layer(h, mask)
        return h


def boundary_values(pipe) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Stage 0's output metadata and stage 1's placeholder metadata (what its receive buffers are made from)."""
    first, second = pipe.get_stage_module(0), pipe.get_stage_module(1)
    output = next(n for n in first.graph.nodes if n.op == "output")
    sent = [n.meta["val"] for n in torch.fx.node.map_aggregate(output.args[0], lambda n: n) if isinstance(n, torch.fx.Node)]
    received = [n.meta["val"] for n in second.graph.nodes if n.op == "placeholder"]
    return sent, received


def test_stage_boundaries_become_contiguous_forward_and_backward():
    torch.manual_seed(0)
    model, x = MaskedStack(), torch.randn(B, L, D, dtype=torch.float64)
    pipe = pipeline(model, (x,), None, split_spec={"layers.1": SplitPoint.BEGINNING})
    sent, received = boundary_values(pipe)
    assert not all(v.is_contiguous() for v in sent + received)  # what gloo refused to send or receive into

    contiguous_boundaries(pipe)
    sent, received = boundary_values(pipe)
    assert all(v.is_contiguous() for v in sent + received)
    first, second = pipe.get_stage_module(0), pipe.get_stage_module(1)
    outputs = first(x)
    assert all(t.is_contiguous() for t in outputs)
    # A received activation (a contiguous buffer) gets a contiguous gradient, which is sent back as it is.
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in outputs]
    result = second(*inputs)
    (grad,) = torch.autograd.grad(result, [inputs[0]], torch.randn_like(result))
    assert grad.is_contiguous()
    # Only layouts changed.
    torch.testing.assert_close(pipe(x)[0], model(x), rtol=0, atol=0)


class SequenceFirst(nn.Module):
    """Returns ``[L, B, D]`` (XLNet's layout): contiguous when traced with one sample, not with more."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h.transpose(0, 1).transpose(0, 1)).transpose(0, 1)


class SequenceFirstStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([SequenceFirst(), nn.Linear(D, D, dtype=torch.float64)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x))


def test_a_stage_output_contiguous_only_at_trace_time_is_sent_contiguous():
    model = SequenceFirstStack()
    pipe = pipeline(model, (torch.randn(1, L, D, dtype=torch.float64),), None, split_spec={"layers.1": SplitPoint.BEGINNING})
    contiguous_boundaries(pipe)
    outputs = pipe.get_stage_module(0)(torch.randn(B, L, D, dtype=torch.float64))
    assert all(t.is_contiguous() for t in outputs)


class Attention(nn.Module):
    """BERT's layout: the projection in a submodule called ``self``, the output in one called ``output``."""

    def __init__(self) -> None:
        super().__init__()
        self.self = nn.Linear(D, D, dtype=torch.float64)
        self.output = nn.Linear(D, D, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x).tanh()) + x


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Attention() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


def test_a_submodule_named_self_runs_in_a_traced_stage():
    """The stages run the graphs' generated code: a node named ``self`` would be assigned over ``self``."""
    torch.manual_seed(0)
    model, x = Encoder(), torch.randn(B, L, D, dtype=torch.float64)
    pipe = _trace(model, (x,), {}, ["layer.1"], training=True)
    torch.testing.assert_close(pipe(x)[0], model(x), rtol=0, atol=0)


def test_batchnorm_layers_that_use_batch_statistics():
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 3, 1), nn.BatchNorm1d(3, track_running_stats=False), nn.GroupNorm(1, 3))
    assert batch_statistics_layers(model, training=True) == ["0", "2"]
    # In evaluation running statistics normalise row by row; a layer without them still uses the batch's.
    assert batch_statistics_layers(model, training=False) == ["2"]


def test_batchnorm_pipelines_are_refused_with_the_reason_and_the_fixes():
    with pytest.raises(ValueError, match=r"ResNet has BatchNorm layers \(bn1, bn2\).*microbatches=4") as error:
        check_pipeline_batch_statistics(["bn1", "bn2"], "ResNet", microbatches=4)
    for fix in ("microbatches=1", "schedule='gpipe'", "GroupNorm or LayerNorm", "sync_batchnorm=True"):
        assert fix in str(error.value)
    with pytest.raises(ValueError, match=r"batch of 6 rows would be padded to the traced 8 rows.*drop_last=True"):
        check_pipeline_batch_statistics(["bn1"], "ResNet", microbatches=1, rows=6, padded_rows=8)
    # One micro-batch of the whole batch is what one device computes; no BatchNorm, nothing to refuse.
    check_pipeline_batch_statistics(["bn1"], "ResNet", microbatches=1, rows=8, padded_rows=8)
    check_pipeline_batch_statistics([], "GPT", microbatches=4, rows=6, padded_rows=8)


class _RoutedExperts(nn.Module):
    """A mixture-of-experts layer written as an eager loop over the experts the batch routes to."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = x.sum(-1).long().remainder(3)
        out = torch.zeros_like(x)
        for e in torch.nonzero(torch.bincount(route, minlength=3)).flatten():
            rows = torch.where(route == e)[0]
            out[rows] = self.experts[e](x[rows])
        return out


def test_an_untraceable_data_dependent_module_is_named_with_the_fix():
    from lightning_parallel.parallelize.pipeline.graph import root_cause, where_trace_stopped

    model = nn.Sequential(nn.Linear(4, 4), _RoutedExperts(), nn.Linear(4, 4))
    with pytest.raises(Exception) as caught:
        _trace(model, (torch.randn(6, 4),), {}, ["2"], training=True)
    where = where_trace_stopped(caught.value)
    assert "_RoutedExperts.forward" in where and "test_pipeline_stages.py" in where, (root_cause(caught.value), where)
    assert "experts_implementation='grouped_mm'" in where


def test_a_split_whose_stage_misses_inputs_is_refused_with_the_stage_named():
    from types import SimpleNamespace

    from lightning_parallel.parallelize.pipeline.graph import check_stage_inputs

    class Two(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_module("inner", (x,)))  # the stage takes (a, b); the split passes only x
    split = torch.fx.GraphModule({"inner": torch.fx.symbolic_trace(Two())}, graph)
    with pytest.raises(TypeError, match=r"gives inner inputs it never receives \(b\)"):
        check_stage_inputs(SimpleNamespace(split_gm=split))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_module("inner", (x, x)))
    check_stage_inputs(SimpleNamespace(split_gm=torch.fx.GraphModule({"inner": torch.fx.symbolic_trace(Two())}, graph)))


class LoopingExperts(nn.Module):
    """Routed experts in transformers' layout whose forward loops over the experts hit (data-dependent shapes)."""

    def __init__(self, experts: int = 4, hidden: int = D, inner: int = 6) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inner, hidden, dtype=torch.float64) / hidden)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inner, dtype=torch.float64) / inner)

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in index.unique().tolist():
            token, choice = torch.where(index == expert)
            gate, up = (hidden[token] @ self.gate_up_proj[expert].T).chunk(2, dim=-1)
            value = (nn.functional.silu(gate) * up) @ self.down_proj[expert].T
            out = out.index_add(0, token, value * weights[token, choice, None])
        return out


class PerExpertScale(nn.Module):
    """One output scale per expert, indexed by the expert ids (Ergo's ``post_expert_norm``)."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(experts, D, dtype=torch.float64) + 0.5)


class ScaledLoopingExperts(LoopingExperts):
    """Routed experts with a parameter in a submodule, which the operator must take as an input too."""

    def __init__(self) -> None:
        super().__init__()
        self.post_expert_norm = PerExpertScale()

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        scaled = torch.zeros_like(hidden)
        for slot in range(index.shape[1]):
            one = torch.zeros_like(weights).scatter(1, torch.full_like(index[:, :1], slot), 1.0) * weights
            scaled = scaled + super().forward(hidden, index, one) * self.post_expert_norm.weight[index[:, slot]]
        return scaled


class MoEBlock(nn.Module):
    def __init__(self, experts: type[nn.Module] = LoopingExperts) -> None:
        super().__init__()
        self.router = nn.Linear(D, 4, bias=False, dtype=torch.float64)
        self.experts = experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, D)
        weights, index = self.router(flat).softmax(-1).topk(2, dim=-1)
        return x + self.experts(flat, index, weights).reshape(x.shape)


class MoEStack(nn.Module):
    def __init__(self, experts: type[nn.Module] = LoopingExperts) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock(experts) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def eager_reference(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``model(x)`` and every parameter's gradient of its output's sum of squares (the gradients then cleared)."""
    expected = model(x)
    expected.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return expected, grads


def trace_and_compare(model: nn.Module, traced: nn.Module, x: torch.Tensor, expected: torch.Tensor, grads: dict) -> list:
    """Trace ``traced`` (``model`` or its meta copy) in two stages cut before ``layers.1``, run them on ``x`` with
    ``model``'s parameters, and check the output and every parameter's gradient against ``expected`` and ``grads``."""
    from lightning_parallel.parallelize.pipeline.build import on_meta

    inputs = (x,) if traced is model else on_meta((x,))
    pipe = _trace(traced, inputs, {}, ["layers.1"], training=True, device=torch.device("cpu"))
    stages = [pipe.get_stage_module(s) for s in range(2)]
    if traced is not model:  # bind the live parameters by name, as the pipeline does for a new trace
        for stage in stages:
            for name, _ in list(stage.named_parameters()):
                owner, _, leaf = name.rpartition(".")
                setattr(stage.get_submodule(owner), leaf, model.get_parameter(name))
    boundary = stages[0](x)
    output = stages[1](*boundary) if isinstance(boundary, tuple) else stages[1](boundary)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-12)
    output.square().sum().backward()
    for name, _ in model.named_parameters():
        stage_param = next(p for stage in stages for n, p in stage.named_parameters() if n == name)
        torch.testing.assert_close(stage_param.grad, grads[name], rtol=0, atol=1e-12, msg=name)
        stage_param.grad = None
    return stages


class StackedGLU(nn.Module):
    """Every expert's weights stacked in 2-D in a submodule of the experts (DBRX's ``DbrxExpertGLU``)."""

    def __init__(self, experts: int = 4, hidden: int = D, inner: int = 6) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts * inner, hidden, dtype=torch.float64) / hidden)
        self.w2 = nn.Parameter(torch.randn(experts * inner, hidden, dtype=torch.float64) / inner)


class NestedStackedExperts(nn.Module):
    """Routed experts holding no parameter themselves, recognised by their call ``(hidden, top_k_index, top_k_weights)``."""

    def __init__(self, experts: int = 4, inner: int = 6) -> None:
        super().__init__()
        self.inner = inner
        self.mlp = StackedGLU(experts, D, inner)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, choice = torch.where(top_k_index == expert)
            w1 = self.mlp.w1.view(-1, self.inner, D)[expert]
            w2 = self.mlp.w2.view(-1, self.inner, D)[expert]
            value = nn.functional.silu(hidden_states[token] @ w1.T) @ w2
            out = out.index_add(0, token, value * top_k_weights[token, choice, None])
        return out


@pytest.mark.parametrize(
    "experts", [LoopingExperts, ScaledLoopingExperts, NestedStackedExperts], ids=["experts", "per_expert_submodule", "nested_2d"]
)
def test_routed_experts_trace_as_one_operator_calling_the_live_module(experts):
    """The experts' data-dependent loop stops torch.export; marked, each experts call is an opaque operator whose
    stages compute the module's own values and gradients (router included), also when traced from a meta copy,
    and also for a parameter in a submodule of the experts (its gradient reaches the stage's copy)."""
    from lightning_parallel.parallelize.pipeline.build import meta_copy
    from lightning_parallel.parallelize.pipeline.opaque_experts import mark_routed_experts

    torch.manual_seed(0)
    model, x = MoEStack(experts), torch.randn(B, L, D, dtype=torch.float64)
    with pytest.raises(Exception):
        _trace(model, (x,), {}, ["layers.1"], training=True)
    expected, grads = eager_reference(model, x)
    assert set(mark_routed_experts(model)) == {"layers.0.experts", "layers.1.experts"}
    for traced in (model, meta_copy(model)):
        stages = trace_and_compare(model, traced, x, expected, grads)
        graphs = [m.graph for m in stages[0].modules() if isinstance(getattr(m, "graph", None), torch.fx.Graph)]
        assert any("routed_experts" in str(node.target) for graph in graphs for node in graph.nodes)


class StraightThrough(torch.autograd.Function):
    """Rounds forward, passes the gradient unchanged backward (quantisation-aware training's estimator)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ReverseGradient(torch.autograd.Function):
    """New-style (``setup_context``): identity forward with a second, non-differentiable output; backward reverses."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, strength: float = 1.0):
        return x * weight, None, x.detach().abs().amax()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, weight, strength = inputs  # keywords arrive bound to their positions
        ctx.save_for_backward(weight, x)
        ctx.strength = strength

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _none, _peak):
        weight, x = ctx.saved_tensors
        return -ctx.strength * grad * weight, -ctx.strength * (grad * x).sum(0), None


class CustomBackwardBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D, dtype=torch.float64)
        self.gain = nn.Parameter(torch.rand(L, D, dtype=torch.float64) + 0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        quantised = StraightThrough.apply(self.linear(h), 4.0)
        reversed_, nothing, peak = ReverseGradient.apply(quantised, weight=self.gain, strength=0.5)
        assert nothing is None
        return reversed_.tanh() + 0 * peak


class CustomBackwardStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CustomBackwardBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_custom_autograd_functions_keep_their_backward_in_traced_stages():
    """torch.export traces through an autograd.Function (round's derivative is zero: a straight-through estimator
    would get no gradient); each call is one operator whose stage runs the Function itself, old- and new-style,
    with keyword, non-tensor and None arguments and outputs, also when traced from a meta copy."""
    from lightning_parallel.parallelize.pipeline.build import meta_copy

    torch.manual_seed(0)
    model, x = CustomBackwardStack(), torch.randn(B, L, D, dtype=torch.float64)
    expected, grads = eager_reference(model, x)
    assert all(g.abs().sum() > 0 for g in grads.values())  # round's own derivative would make them zero
    for traced in (model, meta_copy(model)):
        trace_and_compare(model, traced, x, expected, grads)
    assert torch.autograd.Function.apply.__func__ is torch.autograd.Function.__dict__["apply"].__func__


def _module_in_loop(batch_idx: int, accumulate: int, module_class: type | None = None):
    import lightning as L
    from types import SimpleNamespace

    module = (module_class or L.LightningModule)()
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_idx=batch_idx))
    module._trainer = SimpleNamespace(fit_loop=loop, accumulate_grad_batches=accumulate)
    return module


def test_the_previous_steps_gradients_are_freed_only_where_lightning_would_zero_them():
    """The schedule runs backward inside training_step; the gradients Lightning zeroes after it are freed before
    the schedule instead of living beside the new ones (one gradient set per rank, measured in
    benchmarks/memory_accuracy.py); accumulated ones are added to in place; those a custom optimizer_zero_grad may
    keep are set aside and handed back."""
    import lightning as L

    from lightning_parallel.strategies.components.pipeline.component import _accumulating_in_place, _zeroed_after_step

    assert _zeroed_after_step(_module_in_loop(0, 1)) and _zeroed_after_step(_module_in_loop(7, 1))
    assert _zeroed_after_step(_module_in_loop(4, 2)) and not _zeroed_after_step(_module_in_loop(5, 2))
    # Inside an accumulation window nothing zeroes them: the schedule adds to them in place.
    assert _accumulating_in_place(_module_in_loop(5, 2)) and not _accumulating_in_place(_module_in_loop(4, 2))
    assert not _accumulating_in_place(_module_in_loop(3, 1))

    class KeepsGradients(L.LightningModule):
        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            pass

    assert not _zeroed_after_step(_module_in_loop(0, 1, KeepsGradients))
    manual, manual_inside_window = _module_in_loop(0, 1), _module_in_loop(5, 2)
    manual.automatic_optimization = manual_inside_window.automatic_optimization = False
    assert not _zeroed_after_step(manual) and not _accumulating_in_place(manual_inside_window)
    assert not _zeroed_after_step(nn.Linear(2, 2)) and not _accumulating_in_place(nn.Linear(2, 2))


def test_a_split_layer_whose_submodules_are_called_from_its_forward_traces():
    """torch's ``split_spec`` replaces the split layer's forward on the instance, and export then names the layer's
    submodules relative to it ("attn", not "layers.1.attn"): OpenAI GPT's block failed to unflatten. The split
    points are marked by a forward pre-hook instead, and the stages compute the model's values."""
    from transformers import OpenAIGPTConfig
    from transformers.models.openai.modeling_openai import Block

    config = OpenAIGPTConfig(n_embd=8, n_head=2, n_positions=8, attn_pdrop=0.0, resid_pdrop=0.0)

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block(8, config, scale=True) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)[0]
            return x

    torch.manual_seed(0)
    model, x = Blocks().double(), torch.randn(B, L, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="not a descendant"):
        pipeline(model, (x,), None, split_spec={"layers.1": SplitPoint.BEGINNING})
    model.layers[1].__dict__.pop("_orig_forward"), model.layers[1].__dict__.pop("forward")
    pipe = _trace(model, (x,), {}, ["layers.1"], training=True)
    stages = [pipe.get_stage_module(s) for s in range(2)]
    torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=1e-12)
    assert not any(hook for layer in model.layers for hook in layer._forward_pre_hooks.values())  # hooks removed


class DirectForwardStack(nn.Module):
    """Layers run as ``layer.forward(x)``, as SqueezeBERT's encoder runs them: forward hooks never fire."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()).double() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer.forward(x)
        return x


def test_a_split_layer_its_parent_calls_through_forward_still_begins_a_stage():
    torch.manual_seed(0)
    model, x = DirectForwardStack(), torch.randn(B, D, dtype=torch.float64)
    pipe = _trace(model, (x,), {}, ["layers.1"], training=True)
    assert pipe.num_stages == 2
    stages = [pipe.get_stage_module(s) for s in range(2)]
    torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=1e-12)
    assert "forward" not in model.layers[1].__dict__  # the marker is gone: the class's forward runs again


class NoGradRefinement(nn.Module):
    """A block that first refines its input without gradient (as HRM's cycles do), then once with it."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(D, D, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z = torch.tanh(self.mix(h))
        return h + torch.tanh(self.mix(h + z))


class NoGradStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NoGradRefinement() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_no_grad_block_in_forward_runs_in_its_stage_without_gradient():
    """Export records ``torch.no_grad()`` as an operator holding a subgraph, which torch's split lost ("no attribute
    'submod_1'"); bound into the call it runs in its stage, values and gradients those of the module, also traced
    from a meta copy (the subgraph's meta device retargeted)."""
    from lightning_parallel.parallelize.pipeline.build import meta_copy

    torch.manual_seed(0)
    model, x = NoGradStack(), torch.randn(B, L, D, dtype=torch.float64)
    expected, grads = eager_reference(model, x)
    for traced in (model, meta_copy(model)):
        trace_and_compare(model, traced, x, expected, grads)


class RescalingStack(NoGradStack):
    """Writes into a parameter under ``torch.no_grad()`` in forward (RWKV rescales its weights so)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.layers[0].mix.weight.mul_(1.0)
        return super().forward(x)


def test_a_forward_writing_into_its_parameters_is_refused_with_the_module_and_parameter_named():
    model, x = RescalingStack(), torch.randn(B, L, D, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"writes into its parameters under torch.no_grad\(\) \(layers.0.mix.weight"):
        _trace(model, (x,), {}, ["layers.1"], training=True)


class CyclingStack(NoGradStack):
    """Runs its layers twice (HRM's recurrent cycles over the same blocks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(super().forward(x))


def test_a_split_point_that_runs_twice_per_forward_is_refused_with_its_count():
    model, x = CyclingStack(), torch.randn(B, L, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="layers.1 runs 2 times"):
        _trace(model, (x,), {}, ["layers.1"], training=True)
    assert not model.layers[1]._forward_pre_hooks


class ExpertListStack(nn.Module):
    """Blocks whose MoE keeps its experts as an nn.ModuleList looped over in its own forward (hand-written, and
    transformers 4.x's Mixtral block, which returns ``(hidden, router_logits)``)."""

    def __init__(self, moe: type[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(moe(dim=D, hidden=6, experts=4).double() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            out = layer(x)
            x = x + (out[0] + 1e-2 * out[1].mean() if isinstance(out, tuple) else out)  # router logits used too
        return x


@pytest.mark.parametrize("moe", ["list_moe", "old_mixtral"])
def test_moe_blocks_looping_over_expert_lists_trace_as_one_operator(moe):
    """The whole block (router and data-dependent loop) is one operator: its outputs' structure and shapes learnt by
    a run (a tuple too), its stages computing the block's own values and gradients, also traced from a meta copy;
    the experts lists are not taken for the trunk the pipeline cuts."""
    from lightning_parallel.parallelize.common.trunk import find_trunk
    from lightning_parallel.parallelize.pipeline.build import meta_copy
    from lightning_parallel.parallelize.pipeline.opaque_experts import mark_routed_experts
    from tests.hf_models import ListMoE, OldMixtralBlock

    torch.manual_seed(0)
    model, x = ExpertListStack(ListMoE if moe == "list_moe" else OldMixtralBlock), torch.randn(B, L, D, dtype=torch.float64)
    assert find_trunk(model)[0] == "layers"
    with pytest.raises(Exception):
        _trace(model, (x,), {}, ["layers.1"], training=True)
    expected, grads = eager_reference(model, x)
    mark_routed_experts(model)
    for traced in (model, meta_copy(model)):
        stages = trace_and_compare(model, traced, x, expected, grads)
        graphs = [m.graph for m in stages[0].modules() if isinstance(getattr(m, "graph", None), torch.fx.Graph)]
        assert any("expert_loop_block" in str(node.target) for graph in graphs for node in graph.nodes)
