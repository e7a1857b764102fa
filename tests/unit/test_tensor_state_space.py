"""The automatic tensor-parallel plan on state-space mixers (Mamba-1, Mamba-2), found by structure.

The split's numbers (tp2 against one device, float64) are checked by tests/distributed/test_tensor_plan_families.py
(Mamba, Mamba-2) and the coverage sweep; here: what is recognised, what stays whole and why, and the checks.
"""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig, check_plan, resolve_plan
from lightning_parallel.parallelize.tensor.inference import infer_plan
from lightning_parallel.parallelize.tensor.state_space import (
    StateSpaceLayout,
    check_state_space,
    recognise_gated_norm,
    state_space_layout,
)

transformers = pytest.importorskip("transformers")


def _mamba():
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, expand=2, num_hidden_layers=2)
    return transformers.MambaForCausalLM(config)


def _mamba2(n_groups: int = 1):
    config = transformers.Mamba2Config(vocab_size=64, hidden_size=16, num_heads=4, head_dim=8, expand=2,
                                       n_groups=n_groups, state_size=4, num_hidden_layers=2)
    return transformers.Mamba2ForCausalLM(config)


def test_mamba_mixers_are_split_whole_as_one_unit():
    model = _mamba()
    plan = infer_plan(model)
    assert {fqn: style for fqn, style in plan.items() if "mixer" in fqn} == {
        "backbone.layers.0.mixer": "state_space", "backbone.layers.1.mixer": "state_space"}
    layout = state_space_layout(model.backbone.layers[0].mixer)
    assert isinstance(layout, StateSpaceLayout)
    assert (layout.kind, layout.in_proj, layout.x_proj, layout.dt_proj, layout.out_proj) == (
        "mamba1", "in_proj", "x_proj", "dt_proj", "out_proj")
    assert layout.in_blocks == (32, 32) and set(layout.per_channel) == {"A_log", "D"}
    # The token embedding and the head are still found (in_proj has the head's shape, but belongs to the mixer).
    assert plan["backbone.embeddings"] == "embedding_rowwise"


@pytest.mark.parametrize("n_groups", [1, 2])
def test_mamba2_mixers_split_by_heads_with_their_gated_norm(n_groups):
    model = _mamba2(n_groups)
    mixer = model.backbone.layers[0].mixer
    layout = state_space_layout(mixer)
    assert isinstance(layout, StateSpaceLayout)
    assert layout.kind == "mamba2" and layout.norm == "norm" and not layout.norm_before_gate
    assert layout.in_blocks == (32, 32, 4 * n_groups, 4 * n_groups, 4) and layout.groups == n_groups
    assert check_state_space("mixer", mixer, 2) == layout
    plan = infer_plan(model)
    assert plan["backbone.layers.0.mixer"] == "state_space"
    assert not any(fqn.startswith("backbone.layers.0.mixer.") for fqn in plan)


def test_groups_that_tp_does_not_divide_are_refused():
    mixer = _mamba2(n_groups=2).backbone.layers[0].mixer
    with pytest.raises(ValueError, match=r"n_groups=2 .* tensor_parallel_size=4"):
        check_state_space("mixer", mixer, 4)
    with pytest.raises(ValueError, match=r"its 4 heads are not divisible by tensor_parallel_size=8"):
        check_state_space("mixer", mixer, 8)


def test_a_module_that_is_no_mixer_is_refused_by_the_style():
    model = _mamba()
    with pytest.raises(TypeError, match=r"style 'state_space' splits a Mamba-1 or Mamba-2 mixer"):
        check_plan(model, resolve_plan(model, {"backbone.layers.0.mixer.in_proj": "state_space"}), 2)


def test_gated_norms_are_recognised_by_what_they_compute():
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated
    from transformers.models.mamba2.modeling_mamba2 import Mamba2RMSNormGated as MambaRMSNormGated

    assert recognise_gated_norm(MambaRMSNormGated(8, group_size=8), 1) is False
    assert recognise_gated_norm(MambaRMSNormGated(8, group_size=4), 2) is False
    assert recognise_gated_norm(MambaRMSNormGated(8, group_size=4), 1) is None  # two groups, not one
    assert recognise_gated_norm(FalconH1RMSNormGated(8, n_groups=1, norm_before_gate=True), 1) is True


def test_mixers_stay_whole_under_sequence_parallelism():
    model = _mamba2()
    resolved = TensorParallelConfig(sequence_parallel=True).resolve(model, warn=lambda _: None, tp_size=2)
    assert "state_space" not in resolved.styles.values()
    assert "sequence parallelism" in resolved.kept_whole["backbone.layers.0.mixer"]


def test_mixers_with_per_head_projection_parameters_stay_whole_named():
    class PerHeadMixer(torch.nn.Module):  # Zamba's layout: x_proj/dt_proj as 3-D parameters of the mixer
        def __init__(self):
            super().__init__()
            self.in_proj = torch.nn.Linear(8, 32)
            self.conv1d = torch.nn.Conv1d(16, 16, 3, groups=16)
            self.x_proj_weight = torch.nn.Parameter(torch.zeros(2, 6, 8))
            self.A_log = torch.nn.Parameter(torch.zeros(2, 8, 2))
            self.out_proj = torch.nn.Linear(16, 8)

    notes = []
    plan = infer_plan(PerHeadMixer(), warn=notes.append)
    assert plan == {} and any("one per mixer head (3-D)" in note for note in notes)


def test_a_mixer_on_the_meta_device_is_recognised():
    # Deferred initialisation resolves the plan on meta modules: the gated norm is checked on a CPU copy.
    with torch.device("meta"):
        model = _mamba2()
    assert isinstance(state_space_layout(model.backbone.layers[0].mixer), StateSpaceLayout)


def test_other_modules_with_a_depthwise_convolution_are_no_mixers():
    class ConvBlock(torch.nn.Module):  # a ConvNeXt-like block: depthwise conv, an MLP, a layer scale and a 3-D table
        def __init__(self):
            super().__init__()
            self.dwconv = torch.nn.Conv1d(8, 8, 3, groups=8, padding=1)
            self.pwconv1, self.pwconv2 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)
            self.gamma = torch.nn.Parameter(torch.ones(8))
            self.table = torch.nn.Parameter(torch.zeros(2, 3, 4))

    assert state_space_layout(ConvBlock()) is None
    assert infer_plan(ConvBlock()) == {"pwconv1": "colwise", "pwconv2": "rowwise"}
