"""compile=true in one process: blocks compiled in place, exclusions, failures named, options checked, and
checkpointed blocks compiled whole."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from lightning_parallel.parallelize.common.activation_checkpointing import (
    apply_activation_checkpointing,
)
from lightning_parallel.parallelize.common.compile import (
    CompileConfig,
    compile_blocks,
    trunk_blocks,
)
from recipes.models.gpt import GPT

EAGER_BACKEND = {"backend": "eager"}  # dynamo only: these tests are about the wrapping, not inductor
AOT_BACKEND = {"backend": "aot_eager"}  # dynamo and AOT autograd (which plans checkpointing's recomputation), no inductor


def _gpt() -> GPT:
    return GPT(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=8, dropout=0.0, tie_weights=True)


def test_blocks_are_compiled_in_place_names_and_values_unchanged():
    model, reference = _gpt(), _gpt()
    reference.load_state_dict(model.state_dict())
    names = trunk_blocks(model)
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    compiled = compile_blocks(model, names, CompileConfig(True, EAGER_BACKEND, exclude=["model.blocks.1"]), prefix="model.")
    assert compiled == ["model.blocks.0", "model.blocks.2"]
    assert model.blocks[1]._compiled_call_impl is None
    assert model.state_dict().keys() == reference.state_dict().keys()  # no _orig_mod.
    tokens = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(model(tokens), reference(tokens))
    # Set up again (fit, then validate): nothing is compiled twice.
    assert compile_blocks(model, names, CompileConfig(True, EAGER_BACKEND)) == ["blocks.0", "blocks.1", "blocks.2"]


def _graphs_and_breaks(run: Callable[[], None]) -> tuple[int, dict[str, int]]:
    """Graphs dynamo made and graph breaks it met (reason -> count) while ``run`` first calls compiled code."""
    torch._dynamo.reset()
    counters.clear()
    try:
        run()
        return counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()


def test_checkpointed_blocks_compile_to_graphs_without_breaks():
    """Activation checkpointing then compile, as the strategies order them: each block is one graph (dynamo's
    checkpoint op inside it, recomputed by AOT autograd), not a graph break that leaves the block eager."""
    model, reference = _gpt(), _gpt()
    reference.load_state_dict(model.state_dict())
    names = trunk_blocks(model)
    apply_activation_checkpointing(model, names)
    compile_blocks(model, names, CompileConfig(True, AOT_BACKEND))
    tokens = torch.randint(0, 32, (2, 8))
    losses = []

    def step() -> None:
        losses.append(model(tokens).logsumexp(-1).mean())
        losses[0].backward()

    graphs, breaks = _graphs_and_breaks(step)
    assert (graphs, breaks) == (1, {})  # identical blocks share one graph
    expected = reference(tokens).logsumexp(-1).mean()
    expected.backward()
    torch.testing.assert_close(losses[0], expected)
    for (name, parameter), reference_parameter in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, reference_parameter.grad, msg=name)


def test_a_checkpointed_block_with_python_side_effects_compiles_whole():
    """A block whose forward changes Python state around a call (as transformers' hub-kernel layers do with a
    context variable) compiles to one graph under checkpointing; the change happens once per forward."""

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.calls = nn.Linear(4, 4), 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.proj(x).tanh()

    model = nn.Sequential(Counting(), Counting())
    apply_activation_checkpointing(model, ["0", "1"])
    compile_blocks(model, trunk_blocks(model), CompileConfig(True, AOT_BACKEND))
    graphs, breaks = _graphs_and_breaks(lambda: model(torch.randn(2, 4, requires_grad=True)).sum().backward())
    assert (graphs, breaks) == (1, {})
    assert [block.calls for block in model] == [1, 1]


def test_a_block_that_fails_to_compile_is_named_with_the_way_out():
    class Breaks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._dynamo.graph_break()  # refused under fullgraph=True
            return self.proj(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Breaks(), Breaks()])

    model = Model()
    compile_blocks(model, trunk_blocks(model), CompileConfig(True, {**EAGER_BACKEND, "fullgraph": True}), prefix="model.")
    with pytest.raises(RuntimeError, match=r"torch.compile failed on block 'model.blocks.0'.*compile_exclude=\['model.blocks.0'\]"):
        model.blocks[0](torch.zeros(1, 4))
    torch._dynamo.reset()


def test_compile_options_are_checked():
    with pytest.raises(ValueError, match=r"compile_options has \['fulgraph'\].*Did you mean 'fullgraph'"):
        CompileConfig(True, {"fulgraph": True})
    with pytest.raises(TypeError, match="compile must be true or false"):
        CompileConfig("yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="compile_exclude must be a list of module-name patterns"):
        CompileConfig(True, exclude=[3])  # type: ignore[list-item]
    assert CompileConfig(True, exclude="model.blocks.0").exclude == ("model.blocks.0",)
    with pytest.raises(ValueError, match="compile=true compiles each layer of the model's trunk.*Linear has none"):
        trunk_blocks(nn.Linear(2, 2))
