"""Activation checkpointing keeps the numbers, stores less for backward, and recomputes under the forward's modes."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lightning_parallel.parallelize.common.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpoint_targets,
    inside_mode_carrying_checkpoint,
)
from recipes.models.gpt import GPTLightningModule


def gpt() -> GPTLightningModule:
    torch.manual_seed(0)
    return GPTLightningModule(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=0.0).double()


def saved_bytes_and_grads(module: GPTLightningModule, idx: torch.Tensor) -> tuple[int, dict[str, torch.Tensor], torch.Tensor]:
    """Bytes autograd keeps for backward during forward (the activation memory), then loss and gradients."""
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module(idx).logsumexp(-1).mean()
    loss.backward()
    return saved, {n: p.grad.clone() for n, p in module.named_parameters()}, loss.detach()


def test_checkpointing_changes_no_number_and_lowers_activation_memory():
    idx = torch.randint(0, 64, (4, 16))
    plain, checkpointed = gpt(), gpt()
    names = checkpoint_targets(checkpointed, ["auto"])
    assert names == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert apply_activation_checkpointing(checkpointed, names) == names
    plain_bytes, plain_grads, plain_loss = saved_bytes_and_grads(plain, idx)
    ckpt_bytes, ckpt_grads, ckpt_loss = saved_bytes_and_grads(checkpointed, idx)
    torch.testing.assert_close(ckpt_loss, plain_loss, rtol=0, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=0, atol=1e-12, msg=name)
    # Each block keeps only its input instead of every intermediate (attention, MLP hidden, norms).
    assert ckpt_bytes < 0.35 * plain_bytes, (ckpt_bytes, plain_bytes)
    # Names are unchanged: state dicts and optimizers see no wrapper.
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()


def test_patterns_select_outermost_matches_and_fail_clearly():
    module = gpt()
    assert checkpoint_targets(module, ["model.blocks.*"]) == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert checkpoint_targets(module, ["model.blocks.1.mlp", "model.blocks.1.attn"]) == ["model.blocks.1.mlp", "model.blocks.1.attn"]
    assert checkpoint_targets(module, []) == []
    with pytest.raises(ValueError, match=r"pattern 'model.block.0' matches no submodule of GPTLightningModule. Near matches: model.blocks.0"):
        checkpoint_targets(module, ["model.block.0"])
    with pytest.raises(ValueError, match="activation_checkpointing='auto' needs a list of layers"):
        checkpoint_targets(torch.nn.Linear(2, 2), ["auto"])


def test_recomputation_runs_under_the_forward_function_modes_and_is_marked():
    """The recomputation in backward sees the torch function modes of the forward (context parallelism's is one),
    and both passes count as inside the strategy's checkpointing (context parallelism refuses any other)."""

    class Marker(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    seen: list[tuple[bool, bool]] = []  # (inside the strategy's checkpointing, under the marker mode) per pass

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            from torch.overrides import _get_current_function_mode_stack

            seen.append((inside_mode_carrying_checkpoint(), any(isinstance(m, Marker) for m in _get_current_function_mode_stack())))
            return self.linear(x).tanh()

    blocks = torch.nn.ModuleList([Block()])
    apply_activation_checkpointing(blocks, ["0"])
    x = torch.randn(2, 4, requires_grad=True)
    with Marker():
        y = blocks[0](x).sum()
    assert not inside_mode_carrying_checkpoint()
    y.backward()  # outside the mode: the recomputation enters it again
    assert seen == [(True, True), (True, True)]
    assert not inside_mode_carrying_checkpoint()
