"""The planner on experts kept as an nn.ModuleList: found as the strategy finds them, divided under ep."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_parallel.plan.cost import predict
from lightning_parallel.plan.layouts import Layout, Workload, enumerate_layouts
from tests.planner_check import ANY_HARDWARE, _profile


def test_the_planner_divides_nn_module_list_experts_as_the_fused_ones():
    """Experts kept as an nn.ModuleList (the hand-written MoE, top-2 of 4 SwiGLU experts, and transformers 4.x's
    Mixtral block) are found as the strategy finds them: under ep their memory is divided, their (token, choice)
    pairs travel through the all-to-alls, tensor parallelism leaves them whole, and no pipeline divides them."""
    from lightning_parallel.parallelize.common.expert_lists import find_expert_lists
    from tests.hf_models import ListMoELM

    hardware = replace(ANY_HARDWARE, intra_node_latency_us=0.0)
    listed = _profile("list_moe", 2, 32, False, 4, "64-true", 2)
    old = _profile("old_mixtral", 2, 32, False, 4, "64-true", 1)
    names = {name for lst in find_expert_lists(ListMoELM()).values() for name in lst.parameter_names(range(lst.num_experts))}
    for prof in (listed, old):
        step = prof.step(1)
        assert step.expert_parameters == names and prof.expert_lists and step.expert_counts == (4,)
        # 2 MoE layers × 8 tokens × 2 choices × width 32 × 8 bytes per sample, each block called once.
        assert step.expert_pair_bytes == 2 * 8 * 2 * 32 * 8 and step.expert_calls == 2
    step = listed.step(1)
    experts = sum(step.parameter_bytes[n] for n in names)
    assert experts == 2 * 4 * 3 * 32 * 16 * 8
    workload = Workload(2, 1, 8)
    dp2 = predict(listed, Layout(2, 1, 1), workload, hardware)
    ep2 = predict(listed, Layout(2, 1, 1, ep=2), workload, hardware)
    assert ep2.memory[0].parameters == pytest.approx(dp2.memory[0].parameters - experts / 2)
    assert ep2.comm_bytes["ep"] == pytest.approx(4 * step.expert_pair_bytes * 4)  # 4 samples per replica
    assert dp2.comm_bytes["ep"] == 0
    # Under ep × tp the experts stay whole over tp (its plan leaves them to ep): 1/ep of them per rank, whatever tp.
    tp_workload = Workload(8, 1, 8)
    tp2 = predict(listed, Layout(4, 2, 1), tp_workload, hardware)
    ep4_tp2 = predict(listed, Layout(4, 2, 1, ep=4), tp_workload, hardware)
    split = sum(listed.step(2).parameter_bytes[n] for n in names)
    assert split == experts / 2  # without ep, tp splits each expert as an MLP
    assert ep4_tp2.memory[0].parameters == pytest.approx(tp2.memory[0].parameters - split + experts / 4)
    layouts, _ = enumerate_layouts(Workload(4, 1, 8), 2, {1, 2}, 4, experts=4, expert_lists=True)
    # Inside pipelines too (each MoE block one opaque operator), not yet with tp or cp there.
    assert {(l.dp, l.tp, l.pp) for l in layouts if l.ep > 1} == {(4, 1, 1), (2, 2, 1), (2, 1, 2)}
    layouts, rejected = enumerate_layouts(Workload(8, 1, 8), 2, {1, 2}, 4, fixed={"ep": 2, "pp": 2}, experts=4, expert_lists=True)
    assert {(l.dp, l.tp, l.pp) for l in layouts} == {(4, 1, 2)}
    assert "nn.ModuleList" in rejected["dp=2 × tp=2 × pp=2"]
