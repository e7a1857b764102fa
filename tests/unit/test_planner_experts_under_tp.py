"""The planner under ep × tp: tensor parallelism leaves divided experts whole, so their FLOPs, activations and bytes
per rank are not divided by tp; and a ModuleList MoE block's other work (a shared expert) is counted."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_parallel.plan.cost import _optimizer_step_bytes, predict
from lightning_parallel.plan.layouts import Layout, Workload
from lightning_parallel.plan.profile import profile_model
from tests.harness import JobSpec
from tests.hf_models import ListMoE, ListMoEBlock, ListMoELM, SwiGLUExpert
from tests.planner_check import ANY_HARDWARE, _profile, first_batch

#: FLOPs of one token through one SwiGLU expert of the hand-written MoE (width 32, hidden 16): 3 matmuls.
EXPERT_TOKEN_FLOPS = 2 * 3 * 32 * 16


def test_under_ep_times_tp_each_rank_computes_its_tokens_through_whole_experts():
    """The hand-written ModuleList MoE (2 layers, top-2 of 4 experts, 8 tokens per sample): tp peers hold the same
    tokens and the same whole experts, so each computes every pair its tokens route to them: per sample the experts
    cost what they cost on one device, as do their saved activations, and only the rest is divided by tp (before: the
    experts were divided too)."""
    prof = _profile("list_moe", 2, 32, False, 4, "64-true", 2)
    whole, split = prof.step(1), prof.step(2)
    # Even load: 8 tokens × 2 choices per sample and layer, each through one expert's 3 matmuls, forward.
    experts_forward = 2 * 8 * 2 * EXPERT_TOKEN_FLOPS
    assert sum(whole.expert_forward_flops.values()) == experts_forward
    # Counted in the segments the dry run counts them in (each a part of its segment's FLOPs).
    assert all(value <= whole.forward_flops[segment] for segment, value in whole.expert_forward_flops.items())
    backward = sum(whole.flops.values()) / sum(whole.forward_flops.values())
    experts, rest = experts_forward * backward, sum(whole.flops.values()) - experts_forward * backward
    hardware = replace(ANY_HARDWARE, intra_node_latency_us=0.0)
    workload = Workload(4, 1, 8)  # 4 samples per rank under dp2

    def flops_per_sample(layout: Layout) -> float:
        return predict(prof, layout, workload, hardware).compute_s * hardware.flops_per_device(4) / 4

    # Without ep tp splits each expert as an MLP: about half of everything.
    assert flops_per_sample(Layout(2, 2, 1)) == pytest.approx(sum(split.flops.values()))
    assert sum(split.flops.values()) == pytest.approx((experts + rest) / 2, rel=0.05)
    # With ep the experts are whole on every tp rank: all of their FLOPs, half of the rest.
    assert flops_per_sample(Layout(2, 2, 1, ep=2)) == pytest.approx(experts + rest / 2, rel=0.05)
    # ... as without tp, where ep moves the pairs but each rank still computes as many: the experts' FLOPs are tp's.
    alone = predict(prof, Layout(4, 1, 1, ep=2), workload, hardware)
    assert alone.compute_s * hardware.flops_per_device(4) / 2 == pytest.approx(experts + rest)
    # What the experts save for backward is whole too: their saved bytes as tp split them (at least half: the hidden
    # units halve, the inputs do not) are replaced by the whole ones.
    whole_saved, split_saved = sum(whole.expert_activation_bytes.values()), sum(split.expert_activation_bytes.values())
    assert whole_saved / 2 <= split_saved < whole_saved
    activations = {layout.ep: predict(prof, layout, workload, hardware).memory[0].activations
                   for layout in (Layout(2, 2, 1), Layout(2, 2, 1, ep=2))}
    assert activations[2] - activations[1] == pytest.approx((whole_saved - split_saved) * 4)


def test_the_optimizer_step_holds_temporaries_of_whole_experts_under_ep_times_tp():
    """The optimizer's temporaries are sized by the largest tensor it steps as this rank holds it: a divided expert
    is 1/ep of the whole one whatever tp (before: 1/(ep·tp), from the tp-split profile)."""
    prof = _profile("list_moe", 2, 32, False, 4, "64-true", 2)
    whole, split = prof.step(1), replace(prof.step(2), optimizer_temporaries_per_largest=1.0)
    names = set(split.expert_parameters)
    largest = max(whole.parameter_bytes[n] for n in names)
    assert max(split.parameter_bytes[n] for n in names) == largest / 2  # the tp profile splits them as MLPs
    held = _optimizer_step_bytes(split, whole, Layout(2, 2, 1, ep=2, gradient_as_bucket_view=True), set(), names, 1)
    assert held == largest / 2


class SharedListMoE(ListMoE):
    """The hand-written MoE with a gated shared expert beside the routed ones (Qwen2-MoE's shape)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__(dim)
        self.shared_expert = SwiGLUExpert(dim, 16)
        self.shared_expert_gate = torch.nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class SharedListMoELM(ListMoELM):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(ListMoEBlock(moe=SharedListMoE) for _ in range(2))


def test_a_shared_expert_inside_a_module_list_moe_block_is_counted():
    """The dry run replaces the block's forward (its loop picks tokens by value): the block's other children, a
    shared expert and its gate, are called again on meta as the CPU run recorded them, so their FLOPs, parameters and
    gradients count (before: the shared expert cost nothing), and the routed experts' FLOPs are unchanged."""
    spec = JobSpec(model="list_moe", n_layer=2, n_embd=32, batch_size=4, precision="64-true")
    batch = first_batch(spec)
    plain = profile_model(lambda: ListMoELM(), batch, (1,), dtype=torch.float64).step(1)
    shared = profile_model(lambda: SharedListMoELM(), batch, (1,), dtype=torch.float64).step(1)
    tokens = 8  # per sample
    extra = 2 * tokens * (EXPERT_TOKEN_FLOPS + 2 * 32)  # 2 layers: the shared expert and its 1-wide gate, per token
    assert sum(shared.forward_flops.values()) - sum(plain.forward_flops.values()) == extra
    assert shared.expert_forward_flops == plain.expert_forward_flops
    # The shared expert's parameters are used in the step (their gradients counted), as the rest of the block's.
    used = {name for names in shared.segment_parameters.values() for name in names}
    assert {"layers.0.moe.shared_expert.w1.weight", "layers.1.moe.shared_expert_gate.weight"} <= used
