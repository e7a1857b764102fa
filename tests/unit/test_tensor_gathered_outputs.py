"""Groups that cannot compute on a rank's slice split with their outputs gathered whole, and an MLP beside square
projections: an MLP thresholding its hidden units by their mean and deviation (Gemma-3n), a recurrence over channels
with per-channel decays (RWKV's time mix), RWKV's channel mix (key/value MLP beside a square receptance gate). Split
over two simulated ranks in this process, each must give the whole module's output and gradients (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig
from tests.unit.tp_simulated import split_and_run, whole_run


class ThresholdedMLP(nn.Module):  # Gemma-3n's activation sparsity: a statistic over every hidden unit
    def __init__(self, d: int = 16, h: int = 32) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        gate = self.gate_proj(x)
        gate = torch.relu(gate - (gate.mean(-1, keepdim=True) + 0.5 * gate.std(-1, keepdim=True, unbiased=False)))
        return self.down_proj(torch.nn.functional.gelu(gate) * self.up_proj(x))


class ChannelRecurrence(nn.Module):  # RWKV's time mix: per-channel decays, input mixing, a state of the model's width
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.time_decay, self.time_first = nn.Parameter(torch.randn(d)), nn.Parameter(torch.randn(d))
        self.time_mix_key, self.time_mix_value = nn.Parameter(torch.rand(1, 1, d)), nn.Parameter(torch.rand(1, 1, d))
        self.key, self.value, self.receptance, self.output = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        shifted = torch.nn.functional.pad(x, (0, 0, 1, -1))
        k = self.key(x * self.time_mix_key + shifted * (1 - self.time_mix_key))
        v = self.value(x * self.time_mix_value + shifted * (1 - self.time_mix_value))
        state, outputs = torch.zeros_like(k[:, 0]), []
        for t in range(x.shape[1]):
            outputs.append(torch.tanh(state + self.time_first * k[:, t]) * v[:, t])
            state = state * torch.sigmoid(self.time_decay) + k[:, t]
        # The whole-width state a model would keep (RWKV's state list): needs whole channels.
        assert state.shape[-1] == self.time_decay.shape[0]
        return self.output(torch.sigmoid(self.receptance(x)) * torch.stack(outputs, 1))


class ChannelMix(nn.Module):  # RWKV's feed-forward: key d→h, value h→d, receptance d→d gating the output
    def __init__(self, d: int = 16, h: int = 32) -> None:
        super().__init__()
        self.time_mix_key = nn.Parameter(torch.rand(1, 1, d))
        self.key, self.receptance, self.value = nn.Linear(d, h, bias=False), nn.Linear(d, d, bias=False), nn.Linear(h, d, bias=False)

    def forward(self, x):
        key = torch.square(torch.relu(self.key(x * self.time_mix_key)))
        return torch.sigmoid(self.receptance(x)) * self.value(key)


class Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.block = inner

    def forward(self, x):
        return self.block(x)


@pytest.mark.parametrize("inner, expected_styles", [
    (ThresholdedMLP, {"block.gate_proj": "colwise_gather_output", "block.up_proj": "colwise_gather_output",
                      "block.down_proj": "colwise_gather_output"}),
    (ChannelRecurrence, {f"block.{n}": "colwise_gather_output" for n in ("key", "value", "receptance", "output")}),
    (ChannelMix, {"block.key": "colwise", "block.value": "rowwise", "block.receptance": "replicate"}),
])
def test_split_matches_the_whole_module(simulated_ranks, inner, expected_styles):
    # Before: the thresholded MLP and both RWKV blocks stayed whole (the probe refused the first, nothing matched the
    # others).
    torch.manual_seed(0)
    module, x = Wrapped(inner()).double(), torch.randn(2, 5, 16, dtype=torch.float64)
    expected = whole_run(copy.deepcopy(module), x)
    out, grads, resolved = split_and_run(module, simulated_ranks, x)
    assert resolved.styles == expected_styles
    torch.testing.assert_close(out, expected[0], rtol=0, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][name], rtol=0, atol=1e-12, msg=name)


class HeadedRecurrence(ChannelRecurrence):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 4


class CrossingMix(ChannelMix):  # the square projection's output meets the hidden units: not the split's business
    def __init__(self) -> None:
        super().__init__()
        self.receptance = nn.Linear(16, 16, bias=False)
        self.mix = nn.Parameter(torch.randn(32))

    def forward(self, x):
        return self.value(torch.relu(self.key(x * self.time_mix_key)) * self.mix) * torch.sigmoid(self.receptance(x))


def test_a_recurrence_with_a_head_count_is_left_to_the_attention_rules():
    resolved = TensorParallelConfig().resolve(Wrapped(HeadedRecurrence()), warn=lambda _: None)
    assert resolved.styles == {}


def test_an_mlp_whose_hidden_units_meet_a_whole_parameter_is_split_with_outputs_gathered(simulated_ranks):
    # The probe finds the column/row split wrong (the [h] parameter meets a rank's slice): gathered outputs instead.
    torch.manual_seed(0)
    module, x = Wrapped(CrossingMix()).double(), torch.randn(2, 5, 16, dtype=torch.float64)
    expected = whole_run(copy.deepcopy(module), x)
    out, grads, resolved = split_and_run(module, simulated_ranks, x)
    assert resolved.styles == {"block.receptance": "replicate", "block.key": "colwise_gather_output",
                               "block.value": "colwise_gather_output"}
    torch.testing.assert_close(out, expected[0], rtol=0, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][name], rtol=0, atol=1e-12, msg=name)


class _Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)


def test_under_sequence_parallelism_these_blocks_stay_whole():
    # RWKV's blocks read the previous token, and gathered outputs need every token: whole on a rank's part of the
    # sequence (named), the plain MLP beside them split as before.
    model = nn.ModuleDict({"time": ChannelRecurrence(), "channel": ChannelMix(), "sparse": ThresholdedMLP(), "mlp": _Dense()})
    resolved = TensorParallelConfig(sequence_parallel=True).resolve(model, warn=lambda _: None, tp_size=2)
    assert resolved.styles == {"mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    assert "previous one" in resolved.kept_whole["time"] and "previous one" in resolved.kept_whole["channel"]
    assert "differs from the whole MLP" in resolved.kept_whole["sparse"]
