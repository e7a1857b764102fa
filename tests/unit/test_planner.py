"""The planner: dry-run figures against the real module, layout enumeration, the cost model, refusals, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from lightning_parallel.measure.memory import state_bytes
from lightning_parallel.plan.config import configured_layout, parameter_dtype
from lightning_parallel.plan.cost import (
    bubble_fraction,
    computing_processes,
    in_flight_microbatches,
    pipeline_slots,
    predict,
)
from lightning_parallel.plan.hardware import HardwareProfile
from lightning_parallel.plan.layouts import Layout, Workload, enumerate_layouts
from lightning_parallel.plan.planner import PlanError, plan
from tests.harness import JobSpec, make_model
from tests.planner_check import ANY_HARDWARE, _profile, first_batch

ROOT = Path(__file__).resolve().parents[2]
SPEC = JobSpec(batch_size=8, n_layer=4)


def profile(tp: int = 2):
    return _profile("gpt", SPEC.n_layer, SPEC.n_embd, SPEC.tie_weights, SPEC.batch_size, SPEC.precision, tp)



def test_dry_run_counts_what_the_real_module_holds_after_a_step():
    module = make_model(SPEC).double()
    optimizer = module.configure_optimizers()
    module.training_step(first_batch(SPEC), 0).backward()
    optimizer.step()
    real = state_bytes(module, [optimizer])
    step = profile().step(1)
    assert sum(step.parameter_bytes.values()) == real.parameters
    assert sum(step.optimizer_bytes.values()) == real.optimizer
    # The tied embedding is used before the trunk and by the head after it.
    assert profile().parameter_segments["model.tok_emb.weight"] == ("(before trunk)", "(after trunk)")


def test_tensor_parallel_dry_run_splits_what_the_plan_splits():
    whole, split = profile().step(1), profile().step(2)
    assert split.parameter_bytes["model.blocks.0.attn.q_proj.weight"] * 2 == whole.parameter_bytes["model.blocks.0.attn.q_proj.weight"]
    # The tied embedding and head: one tensor, split over the vocabulary like any untied pair.
    assert split.parameter_bytes["model.tok_emb.weight"] * 2 == whole.parameter_bytes["model.tok_emb.weight"]
    # Megatron's pattern: per block one all-reduce after attention and one after the MLP, each way.
    # Plus the vocabulary split: the embedding's all-reduce, the head's all-gather and its input gradient's all-reduce.
    assert split.tp_collectives == 4 * SPEC.n_layer + 3
    assert split.activation_bytes["model.blocks.0"] < whole.activation_bytes["model.blocks.0"]
    # n_head=2 cannot be split 4 ways: refused with the reason, not profiled.
    four = _profile("gpt", SPEC.n_layer, SPEC.n_embd, SPEC.tie_weights, SPEC.batch_size, SPEC.precision, 4)
    assert 4 not in four.steps and "n_head=2" in four.tp_invalid[4]
    with pytest.raises(ValueError, match="tensor_parallel_size=4 cannot be planned"):
        four.step(4)


def test_dry_run_of_a_transformers_model_as_users_build_it():
    # transformers' mask helpers ask the position ids for values ((...).all()) unless the model is being compiled:
    # the dry run runs it as a trace, so meta tensors need none.
    pytest.importorskip("transformers")
    from lightning_parallel.plan.profile import profile_model
    from recipes.models.transformers_lm import TransformersCausalLM

    config = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    batch = (torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16)))
    profiled = profile_model(lambda: TransformersCausalLM("llama", vocab_size=64, block_size=16, config=config), batch, (1, 2))
    whole, split = profiled.step(1), profiled.step(2)
    assert profiled.segments[1:3] == ("model.model.layers.0", "model.model.layers.1")
    q = "model.model.layers.0.self_attn.q_proj.weight"
    assert split.parameter_bytes[q] * 2 == whole.parameter_bytes[q] and sum(split.flops.values()) < sum(whole.flops.values())


def test_precision_sets_the_parameter_dtype():
    assert parameter_dtype("64-true") is torch.float64
    assert parameter_dtype("bf16-true") is torch.bfloat16
    assert parameter_dtype("bf16-mixed") is None  # float32 master weights


def test_bubble_and_in_flight_micro_batches():
    assert bubble_fraction("1f1b", 2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction("gpipe", 4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction("interleaved_1f1b", 4, 8, stages_per_rank=2) == pytest.approx(3 / 19)
    assert bubble_fraction("none", 1, 1) == 0.0
    assert in_flight_microbatches("gpipe", 4, 0, 16, 1) == 16
    assert [in_flight_microbatches("1f1b", 4, r, 16, 1) for r in range(4)] == [4, 3, 2, 1]


def test_a_pipelines_bubble_computes_at_the_rate_of_the_processes_computing_at_once():
    """On a node whose processes outnumber its cores, each slot of the schedule runs at the crowded rate of the
    processes computing in it: all of them in the steady state, 1, 2, … in the warm-up and cool-down, which therefore
    take less than the steady state's time per micro-batch; a process computing beside idle cores is counted at the
    uncrowded rate (its threads are the job's), and nothing changes where every process has a core."""
    assert pipeline_slots(4, 8) == [1, 2, 3, 4, 4, 4, 4, 4, 3, 2, 1]  # m + p − 1 slots, p·m stage-micro-batches
    assert pipeline_slots(4, 2) == [1, 2, 2, 2, 1] and sum(pipeline_slots(4, 8, 2)) == 4 * 8 * 2
    # dp=2 × pp=2 on 4 processes: both replicas' ranks of a slot compute; never counted below the cores (2 here).
    assert computing_processes(Layout(2, 1, 2, schedule="1f1b", microbatches=4), 4, cores=2) == [2, 4, 4, 4, 2]
    assert computing_processes(Layout(1, 1, 4, schedule="1f1b", microbatches=4), 4, cores=2) == [2, 2, 3, 4, 3, 2, 2]
    prof, workload, layout = profile(1), Workload(4, 1, 8), Layout(1, 1, 4, schedule="1f1b", microbatches=8)
    # Datasheet-style profile, transfers free: a micro-batch is its FLOPs at the process's rate.
    base = replace(ANY_HARDWARE, intra_node_gbps=1e9, intra_node_latency_us=0.0, achievable_fraction=1.0)
    own_core = predict(prof, layout, workload, replace(base, node_tflops=400.0, host_cores=4))  # every process: 100
    crowded = predict(prof, layout, workload, replace(base, node_tflops=200.0, host_cores=2, crowded_node_tflops={4: 150.0}))
    assert own_core.step_s == pytest.approx(11 * own_core.compute_s / 8)  # (m + p − 1) micro-batches: the usual bubble
    per_process = {1: 100.0, 2: 100.0, 3: 175.0 / 3, 4: 150.0 / 4}  # 3: between the cores' 200 and the crowded 150
    micro_at_100 = own_core.compute_s / 8
    assert crowded.step_s == pytest.approx(sum(micro_at_100 * 100.0 / per_process[n] for n in pipeline_slots(4, 8)))
    all_crowded = 11 * micro_at_100 * 100.0 / per_process[4]  # what every slot at the steady state's rate would take
    assert crowded.step_s < 0.8 * all_crowded
    # The last rank computes in slots 3..10 (4, 4, 4, 4, 4, 3, 2, 1 processes at once); the rest of the step it waits.
    assert crowded.compute_s == pytest.approx(sum(micro_at_100 * 100.0 / per_process[n] for n in [4] * 5 + [3, 2, 1]))
    assert crowded.bubble_s == pytest.approx(crowded.step_s - crowded.compute_s - crowded.comm_s)
    # As many processes as cores: each computes on its own core (its threads set for the job) in the bubble as in
    # the steady state, even where one alone would be faster than its share of the node (peak 100 > 150 / 2).
    two = predict(prof, Layout(1, 1, 2, schedule="1f1b", microbatches=4), Workload(2, 1, 8),
                  replace(base, node_tflops=150.0, host_cores=2, crowded_node_tflops={4: 120.0}))
    assert two.step_s == pytest.approx(5 * two.compute_s / 4)
    # Without a pipeline every process computes all the time: the crowded rate of all of them.
    dp = [predict(prof, Layout(4, 1, 1), Workload(4, 1, 32), replace(base, **node))
          for node in ({"node_tflops": 400.0, "host_cores": 4}, {"node_tflops": 200.0, "host_cores": 2, "crowded_node_tflops": {4: 150.0}})]
    assert dp[1].compute_s == pytest.approx(dp[0].compute_s * 100.0 / per_process[4])


def test_enumeration_covers_every_valid_split_and_says_why_not():
    workload = Workload(devices_per_node=8, num_nodes=1, global_batch=32)
    layouts, rejected = enumerate_layouts(workload, trunk_layers=4, tensor_parallel_sizes={1, 2}, devices_per_node=8)
    assert all(l.dp * l.tp * l.pp == 8 for l in layouts)
    sizes = {(l.dp, l.tp, l.pp) for l in layouts}
    assert {(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 2, 4), (2, 1, 4)} <= sizes
    assert "pp=8" in rejected["dp=1 × tp=1 × pp=8"]
    assert "4 ways" in rejected["dp=2 × tp=4 × pp=1"]
    assert all(l.microbatches >= l.pp and (32 // l.dp) % l.microbatches == 0 for l in layouts)
    pinned, _ = enumerate_layouts(workload, 4, {1, 2}, 8, fixed={"tp": 2})
    assert pinned and {l.tp for l in pinned} == {2}


def test_prediction_of_the_data_parallel_layout_is_the_seed_formula():
    """dp=k, no TP/PP: T_step = T_compute/k + T_comm, as in the seed document."""
    hardware = replace(ANY_HARDWARE, intra_node_latency_us=0.0)
    workload = Workload(devices_per_node=4, num_nodes=1, global_batch=32)
    single = predict(profile(), Layout(1, 1, 1), Workload(1, 1, 32), hardware)
    four = predict(profile(), Layout(4, 1, 1), workload, hardware)
    t_compute = single.step_s
    t_comm = 2 * 3 / 4 * four.comm_bytes["dp"] / (hardware.intra_node_gbps * 1e9)
    assert four.step_s == pytest.approx(t_compute / 4 + t_comm)
    assert four.speedup == pytest.approx(t_compute / (t_compute / 4 + t_comm))
    assert four.efficiency == pytest.approx(four.speedup / 4)


def test_context_parallel_prediction_divides_tokens_and_adds_the_ring():
    """cp=2 on 2 ranks: half of every sequence per rank (compute, activations), the whole model's gradients
    averaged over the cp pair, and the ring's key/value traffic: three passes of each layer's K and V."""
    hardware = replace(ANY_HARDWARE, intra_node_latency_us=0.0)
    prof = profile()
    single = predict(prof, Layout(1, 1, 1), Workload(1, 1, 8), hardware)
    cp2 = predict(prof, Layout(1, 1, 1, cp=2), Workload(2, 1, 8), hardware)
    assert cp2.layout.describe() == "dp=1 × cp=2 × tp=1 × pp=1"
    assert "strategy.context_parallel_size=2" in cp2.layout.overrides(8)
    assert cp2.compute_s == pytest.approx(single.compute_s / 2)
    assert cp2.memory[0].activations == pytest.approx(single.memory[0].activations / 2)
    assert cp2.memory[0].parameters == single.memory[0].parameters  # replicas of the weights
    kv = sum(2 * prof.layer_input_bytes[layer] for layer in prof.trunk_layers) * 8  # the whole batch's K and V
    # Forward and backward gather half of it each; backward passes the gradients in two exchanges of half. The
    # model's outputs (logits) are gathered whole: each rank hands its half and receives the other.
    logits = prof.output_bytes * 8
    assert logits > 0
    assert cp2.comm_bytes["cp"] == pytest.approx(kv / 2 + kv / 2 + kv + logits / 2)
    assert cp2.wire_bytes["cp"] == pytest.approx(3 * kv / 2 + logits / 2)
    assert cp2.cp_s == pytest.approx(cp2.wire_bytes["cp"] / (hardware.intra_node_gbps * 1e9))
    assert cp2.comm_bytes["dp"] == single.memory[0].gradients  # gradients all-reduced over the cp pair
    assert cp2.step_s == pytest.approx(cp2.compute_s + cp2.cp_s + cp2.dp_s)
    layouts, rejected = enumerate_layouts(Workload(4, 1, 8), 4, {1, 2}, 4, fixed={"cp": 2})
    assert layouts and {l.cp for l in layouts} == {2} and all(l.world_size == 4 for l in layouts)
    assert any(l.pp == 2 for l in layouts)  # context parallelism inside pipelines (issue 28)


def test_plan_refuses_what_cannot_run():
    workload = Workload(devices_per_node=4, num_nodes=1, global_batch=32)
    tiny = replace(ANY_HARDWARE, device_memory_gib=1e-5)
    with pytest.raises(PlanError, match="does not fit on 4 × any in any layout"):
        plan(profile(), workload, tiny)
    with pytest.raises(PlanError, match="tp=3 does not divide the world size 4"):
        plan(profile(), workload, ANY_HARDWARE, fixed={"tp": 3})
    with pytest.raises(PlanError, match="trainer.devices=16 processes per node"):
        plan(profile(), Workload(16, 1, 32), ANY_HARDWARE)
    with pytest.raises(PlanError, match="does not divide into dp=4"):
        plan(profile(), Workload(4, 1, 6), ANY_HARDWARE, fixed={"dp": 4})


def test_plan_never_recommends_a_layout_that_does_not_fit():
    workload = Workload(devices_per_node=4, num_nodes=1, global_batch=32)
    everything = plan(profile(), workload, ANY_HARDWARE).predictions
    fastest = min(everything, key=lambda p: p.step_s)
    # Memory just under what the fastest layout needs: it must be passed over for a slower one that fits.
    hardware = replace(ANY_HARDWARE, device_memory_gib=fastest.peak_memory * 0.99 / 2**30, memory_reserve_fraction=0.0)
    result = plan(profile(), workload, hardware)
    assert result.recommended.fits and result.recommended.layout != fastest.layout
    assert any("out of memory" in reason for reason in result.reasons)
    fits = [p.fits for p in result.predictions]
    assert fits == sorted(fits, reverse=True)


def test_hardware_profiles_load_and_bad_ones_are_refused():
    for path in sorted((ROOT / "lightning_parallel" / "conf" / "hardware").glob("*.yaml")):
        profile_ = HardwareProfile.from_config(yaml.safe_load(path.read_text()))
        # auto is whatever this machine is: cpu_local here (tests/unit/test_auto_hardware.py).
        assert profile_.name == ("cpu_local" if path.stem == "auto" else path.stem) and profile_.usable_memory_bytes > 0
    good = yaml.safe_load((ROOT / "lightning_parallel" / "conf" / "hardware" / "h100_ib.yaml").read_text())
    with pytest.raises(ValueError, match="unknown key"):
        HardwareProfile.from_config({**good, "nvlink": True})
    with pytest.raises(ValueError, match=r"hardware.intra_node_gbps=0"):
        HardwareProfile.from_config({**good, "intra_node_gbps": 0})
    with pytest.raises(ValueError, match=r"hardware.send_latency_us=-5 must be a number of microseconds"):
        HardwareProfile.from_config({**good, "send_latency_us": -5})


def test_configured_layout_reads_the_strategy_config():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        hybrid = compose("config", overrides=["strategy=hybrid", "trainer.devices=8", "strategy.tensor_parallel_size=2",
                                              "strategy.pipeline_parallel_size=2", "strategy.schedule=gpipe"])
        data = compose("config", overrides=["strategy=data", "trainer.devices=4"])
        tensor = compose("config", overrides=["strategy=tensor", "trainer.devices=2"])
    assert configured_layout(hybrid) == Layout(2, 2, 2, schedule="gpipe", microbatches=4)
    assert configured_layout(data) == Layout(4, 1, 1)
    assert configured_layout(tensor) == Layout(1, 2, 1)


def run_cli(capsys, *args: str) -> tuple[int, str]:
    """``python -m lightning_parallel.plan ARGS`` in this process (from the project root); exit status and output."""
    from lightning_parallel.plan.__main__ import main

    status = main([*args, "--config-dir", str(ROOT / "conf")])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def test_cli_prints_json_with_a_recommendation_that_fits(capsys):
    status, output = run_cli(capsys, "trainer.devices=4", "model.n_layer=2", "--json", "-")
    assert status == 0, output[-3000:]
    result = json.loads(output[output.index("{"):])
    best = result["recommended"]
    assert best["fits"] and best["layout"]["dp"] * best["layout"]["tp"] * best["layout"]["pp"] == 4
    assert result["candidates"][0]["describe"] == best["describe"] and result["reasons"]
    assert "strategy=hybrid" in best["overrides"]


def test_cli_refuses_an_impossible_request_clearly(capsys):
    status, output = run_cli(capsys, "trainer.devices=4", "--tp", "3")
    assert status == 2
    assert "tp=3 does not divide the world size 4" in " ".join(output.split())


def test_setup_peak_counts_the_whole_model_for_a_pipeline_built_eagerly():
    """A pipeline is cut on the first batch: built eagerly, each rank holds the whole model until then;
    built on the meta device (empty_init), only its stages."""
    layout = Layout(1, 1, 2, schedule="1f1b", microbatches=2)
    eager = predict(profile(), layout, Workload(2, 1, 8), ANY_HARDWARE)
    meta = predict(profile(), layout, Workload(2, 1, 8, empty_init=True), ANY_HARDWARE)
    whole = predict(profile(), Layout(1, 1, 1), Workload(1, 1, 8), ANY_HARDWARE).memory[0].parameters
    assert [m.setup for m in eager.memory] == [whole, whole]
    assert [m.setup for m in meta.memory] == [m.parameters for m in meta.memory]
    assert all(m.setup < whole for m in meta.memory)
    assert eager.peak_memory >= whole and any("empty_init=true" in note for note in eager.notes)
    assert not any("empty_init" in note for note in meta.notes)
    # Tensor parallelism splits on the host before the move: its setup is its part only.
    tp = predict(profile(), Layout(1, 2, 1), Workload(2, 1, 8), ANY_HARDWARE)
    assert tp.memory[0].setup == tp.memory[0].parameters


def test_expert_parallel_prediction_divides_the_experts_and_adds_the_all_to_alls():
    """dp=4 with ep=2 (the recipe GPT with 4 experts per block, top-2): each rank holds half of every expert,
    the dense gradients are all-reduced over dp, the experts' over the 2 ranks holding the same ones, and every
    (token, choice) pair's hidden states travel out and back, forward and backward."""
    hardware = replace(ANY_HARDWARE, intra_node_latency_us=0.0)
    prof = _profile("gpt_moe", SPEC.n_layer, SPEC.n_embd, SPEC.tie_weights, SPEC.batch_size, SPEC.precision, 1)
    step = prof.step(1)
    experts = sum(step.parameter_bytes[n] for n in step.expert_parameters)
    assert step.expert_parameters and experts == SPEC.n_layer * 2 * 4 * (4 * SPEC.n_embd * SPEC.n_embd) * 8  # float64
    # 8 tokens × 2 choices × n_embd values per sample and MoE layer.
    assert step.expert_pair_bytes == SPEC.n_layer * 8 * 2 * SPEC.n_embd * 8
    workload = Workload(4, 1, 32)
    dp4 = predict(prof, Layout(4, 1, 1), workload, hardware)
    ep2 = predict(prof, Layout(4, 1, 1, ep=2), workload, hardware)
    assert ep2.layout.describe() == "dp=4 × tp=1 × pp=1 · ep=2"
    assert "strategy.expert_parallel_size=2" in ep2.layout.overrides(8)
    assert ep2.memory[0].parameters == pytest.approx(dp4.memory[0].parameters - experts / 2)
    assert ep2.comm_bytes["dp"] == pytest.approx(dp4.comm_bytes["dp"] - experts / 2)
    assert ep2.comm_bytes["ep"] == pytest.approx(4 * step.expert_pair_bytes * 8)  # 8 samples per replica
    assert ep2.ep_s == pytest.approx(ep2.wire_bytes["ep"] / (hardware.intra_node_gbps * 1e9))
    assert dp4.comm_bytes["ep"] == 0 and dp4.ep_s == 0


def test_the_planner_compares_expert_parallel_layouts_of_a_moe_model_and_honours_a_pinned_ep():
    """ep divides dp's ranks and every MoE layer's experts (4 here), inside pipelines too (with tp, replicated or
    sharded dp): the planner compares those layouts for the recipe MoE (only); a pinned ep is kept, or refused with the
    reason."""
    prof = _profile("gpt_moe", SPEC.n_layer, SPEC.n_embd, SPEC.tie_weights, SPEC.batch_size, SPEC.precision, 1)
    assert prof.experts_divisor == 4 and profile().experts_divisor == 0
    workload = Workload(8, 1, 64)
    layouts, _ = enumerate_layouts(workload, SPEC.n_layer, {1, 2, 4}, 8, experts=prof.experts_divisor)
    assert {(l.dp, l.pp, l.ep) for l in layouts if l.ep > 1} == {
        (8, 1, 2), (8, 1, 4), (4, 1, 2), (4, 1, 4), (2, 1, 2), (4, 2, 2), (4, 2, 4), (2, 4, 2), (2, 2, 2)}
    inside_pipelines = [l for l in layouts if l.ep > 1 and l.pp > 1]
    assert {l.tp for l in inside_pipelines} == {1, 2}  # dp2 ep2 × tp2 × pp2 among them
    assert {l.data_parallel_mode for l in inside_pipelines} >= {"replicate", "shard"}
    dense, _ = enumerate_layouts(workload, SPEC.n_layer, {1, 2, 4}, 8)
    assert {l.ep for l in dense} == {1}
    pinned, rejected = enumerate_layouts(workload, SPEC.n_layer, {1, 2, 4}, 8, fixed={"ep": 4}, experts=4)
    assert {l.ep for l in pinned} == {4} and {(l.dp, l.pp) for l in pinned} == {(4, 1), (8, 1), (4, 2)}
    assert "ep=4 must divide dp=2" in rejected["dp=2 × tp=4 × pp=1"]
    result = plan(prof, workload, ANY_HARDWARE, fixed={"ep": 2})
    assert result.recommended.layout.ep == 2


def test_dtensor_operators_are_counted_and_cost_their_measured_host_time():
    """The dry run counts the operators a tensor-parallel step dispatches on DTensors (none without TP); each costs
    the hardware's measured host time, more when the node's processes outnumber its cores."""
    prof = profile()
    ops = prof.step(2).dtensor_ops
    assert prof.step(1).dtensor_ops == 0 and ops > 100
    workload = Workload(2, 1, 8)
    hardware = replace(ANY_HARDWARE, node_tflops=None)
    without = predict(prof, Layout(1, 2, 1), workload, hardware)
    timed = predict(prof, Layout(1, 2, 1), workload, replace(hardware, dtensor_op_us=100.0, host_cores=1))
    assert timed.compute_s == pytest.approx(without.compute_s + ops * 100e-6 * 2)  # 2 processes on 1 core
    assert predict(prof, Layout(2, 1, 1), workload, replace(hardware, dtensor_op_us=100.0)).compute_s == pytest.approx(
        predict(prof, Layout(2, 1, 1), workload, hardware).compute_s)


def test_a_measured_host_predicts_a_roofline_of_matmuls_memory_traffic_and_operators():
    """With a measured host (memory bandwidth, operator host time, matmul efficiency by kind) a rank's compute is
    its matmul FLOPs at the peak their kinds reach, plus the bytes its other operators move at the bandwidth, plus
    every operator's host time, plus its optimizer step (operators per parameter tensor, bytes per parameter byte;
    DTensor parameters at DTensor's cost): each term from the dry run's counts, on this rank's local tensors."""
    prof = profile()
    whole, split = prof.step(1), prof.step(2)
    assert whole.ops > whole.dtensor_ops == 0 and split.ops > split.dtensor_ops > 0
    assert sum(whole.memory_bytes.values()) > 0 and set(whole.memory_bytes) == set(prof.segments)
    assert all(kind.startswith(("matmul/", "attention/")) for kind in whole.matmul_flops_by_kind)
    workload = Workload(1, 1, 8)
    flops_only = predict(prof, Layout(1, 1, 1), workload, replace(ANY_HARDWARE, node_tflops=None))
    roofline = replace(ANY_HARDWARE, node_tflops=None, achievable_fraction=1.0, memory_gbps=10.0, op_us=5.0,
                       optimizer_op_us=2.0, optimizer_dtensor_op_us=20.0, matmul_efficiency=dict.fromkeys(whole.matmul_flops_by_kind, 0.5))
    # AdamW: several operators per parameter tensor, each reading and writing more than the parameter.
    assert whole.optimizer_ops_per_tensor >= 5 and whole.optimizer_moved_per_byte >= 5
    assert not whole.dtensor_parameters and split.dtensor_parameters
    optimizer = (len(whole.parameter_bytes) * whole.optimizer_ops_per_tensor * 2e-6
                 + whole.optimizer_moved_per_byte * sum(whole.parameter_bytes.values()) / 10e9)
    expected = (2 * flops_only.compute_s * ANY_HARDWARE.achievable_fraction  # the FLOPs, at half the peak
                + sum(whole.memory_bytes.values()) * 8 / 10e9 + whole.ops * 5e-6 + optimizer)
    assert predict(prof, Layout(1, 1, 1), workload, roofline).compute_s == pytest.approx(expected)


def test_gpu_check_calibrates_the_datasheet_profile_of_the_gpu_it_ran_on():
    """benchmarks/gpu_check.py writes the GPU's profile again with its measured MFU as the achievable fraction."""
    from benchmarks.gpu_check import CALIBRATING_VARIANT, calibrated_profile

    name, text = calibrated_profile({CALIBRATING_VARIANT: {"mfu": 0.52, "device": "NVIDIA H100 80GB HBM3"}}, smoke=False)
    assert name == "h100_ib_calibrated.yaml" and "hardware=h100_ib_calibrated" in text
    profile = HardwareProfile.from_config(yaml.safe_load(text))
    assert profile.name == "h100_ib_calibrated" and profile.achievable_fraction == 0.52 and profile.peak_tflops == 989
    assert calibrated_profile({CALIBRATING_VARIANT: {"error": "out of memory"}}, smoke=False) is None
    assert calibrated_profile({CALIBRATING_VARIANT: {"mfu": 0.5, "device": "Some Other GPU"}}, smoke=False) is None


def test_ddp_bucket_copy_of_the_gradients_is_predicted_unless_they_alias_the_buckets():
    workload = Workload(devices_per_node=2, num_nodes=1, global_batch=8)
    copied = predict(profile(1), Layout(dp=2, tp=1, pp=1), workload, ANY_HARDWARE)
    aliased = predict(profile(1), Layout(dp=2, tp=1, pp=1, gradient_as_bucket_view=True), workload, ANY_HARDWARE)
    gradients = copied.memory[0].gradients
    assert gradients > 0 and copied.memory[0].transient - aliased.memory[0].transient == pytest.approx(gradients)
    assert any("gradient_as_bucket_view=true" in note for note in copied.notes)
    assert not any("gradient_as_bucket_view" in note for note in aliased.notes)
    sharded = predict(profile(1), Layout(dp=2, tp=1, pp=1, data_parallel_mode="shard", shard_size=2), workload, ANY_HARDWARE)
    assert not any("gradient_as_bucket_view" in note for note in sharded.notes)  # FSDP2 has no DDP buckets


def test_peak_memory_counts_what_the_module_held_and_what_the_run_allocated():
    from lightning_parallel.measure.peak_memory import PeakMemory, held_tensor_bytes

    module = torch.nn.Linear(1024, 1024)  # 4 MiB of weight held before tracking starts
    held = held_tensor_bytes(module)
    assert held == (1024 * 1024 + 1024) * 4
    tracker = PeakMemory()
    tracker.start(module, torch.device("cpu"))
    if tracker.peak_bytes() is None:
        pytest.skip("no /proc/self/status here")
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    peak = tracker.peak_bytes()
    tracker.stop()
    del block
    assert peak >= held + 60 * 2**20


def test_a_cpu_peak_leaves_out_the_freed_blocks_glibc_keeps_resident():
    """A freed 16 MiB block raises glibc's mmap threshold, so 1 MiB blocks then come from the heap and stay resident
    when freed: the resident set keeps them, the allocated bytes do not."""
    from lightning_parallel.measure.peak_memory import PeakMemory, _status_bytes, allocated_bytes

    if allocated_bytes() is None or _status_bytes("VmRSS") is None:
        pytest.skip("no glibc mallinfo2 or /proc here")
    torch.ones(16 * 2**20 // 4).add_(1)  # allocated (mapped), touched and freed at once
    tracker = PeakMemory()
    tracker.start(torch.nn.Linear(1, 1), torch.device("cpu"))
    resident, allocated = _status_bytes("VmRSS"), allocated_bytes()
    blocks = [torch.ones(2**20 // 4) for _ in range(8)]  # 8 MiB, touched
    held = tracker.peak_bytes()
    del blocks
    if _status_bytes("VmRSS") - resident < 4 * 2**20:
        pytest.skip("this allocator returned the blocks to the OS: nothing to leave out")
    assert allocated_bytes() - allocated < 2**20
    assert held >= 8 * 2**20
    sampler = tracker._sampler
    tracker.stop()
    assert sampler is not None and not sampler.is_alive()  # the sampling thread ends with the tracking


def test_the_optimizer_steps_temporaries_are_measured_as_the_optimizer_allocates_them():
    """AdamW's per-tensor loop holds a square root and a denominator of the tensor it steps, and the previous
    tensor's denominator until it is reassigned: 2x one tensor alone, 3x two equal tensors, whatever the device."""
    from lightning_parallel.measure.dispatch import TemporaryPeak

    for device, count in (("meta", 1), ("meta", 2), ("cpu", 2)):
        params = [torch.nn.Parameter(torch.zeros(256, 256, device=device)) for _ in range(count)]
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer = torch.optim.AdamW(params)
        optimizer.step()  # the state
        with TemporaryPeak() as temporaries:
            optimizer.step()
        assert temporaries.peak == (count + 1) * 256 * 256 * 4, (device, count)
        assert temporaries.live == 0  # every temporary freed by the end of the step


def test_the_optimizer_step_and_the_runtimes_are_in_the_predicted_peak():
    workload = Workload(devices_per_node=2, num_nodes=1, global_batch=8)
    step = profile(1).step(1)
    assert step.optimizer_temporaries_per_largest >= 2  # AdamW, measured on meta
    largest = max(step.parameter_bytes.values())
    hardware = replace(ANY_HARDWARE, pipeline_runtime_bytes=30 * 2**20, training_runtime_bytes=2**20)
    single = predict(profile(1), Layout(dp=1, tp=1, pp=1), replace(workload, devices_per_node=1, global_batch=4), hardware)
    memory = single.memory[0]
    assert memory.optimizer_step == pytest.approx(step.optimizer_temporaries_per_largest * largest)
    assert memory.runtime == 2**20  # every training process's own allocations; a pipeline's tracing besides
    assert memory.peak == max(memory.total, memory.state + memory.runtime + memory.optimizer_step, memory.setup)
    pipeline = predict(profile(1), Layout(dp=1, tp=1, pp=2, schedule="1f1b", microbatches=2), workload, hardware)
    assert all(m.runtime == 31 * 2**20 and m.peak >= m.state + m.runtime + m.optimizer_step for m in pipeline.memory)


def test_collectives_are_charged_by_how_their_ranks_meet_them():
    """A gradient all-reduce meets ranks arriving from their own compute (the collective latency); tensor parallelism's
    meet ranks in lockstep (the lockstep latency); a pipeline's sends meet a stage already waiting (the send latency)."""
    hardware = replace(ANY_HARDWARE, intra_node_gbps=1e9, intra_node_latency_us=1000.0, lockstep_latency_us=400.0, send_latency_us=50.0)
    slower = replace(hardware, lockstep_latency_us=600.0, send_latency_us=150.0)
    workload = Workload(devices_per_node=2, num_nodes=1, global_batch=8)
    tp, tp_slower = (predict(profile(), Layout(1, 2, 1), workload, h) for h in (hardware, slower))
    assert tp_slower.tp_s - tp.tp_s == pytest.approx(profile().step(2).tp_collectives * 200e-6)
    pipeline = [predict(profile(), Layout(1, 1, 2, schedule="1f1b", microbatches=4), workload, h) for h in (hardware, slower)]
    # Each rank's micro-batch: its output forward and its input's gradient back, two sends of the critical path.
    assert pipeline[1].p2p_s - pipeline[0].p2p_s == pytest.approx(4 * 2 * 100e-6)
    dp = [predict(profile(), Layout(2, 1, 1), workload, h) for h in (hardware, slower)]
    assert dp[0].dp_s == dp[1].dp_s  # the gradient all-reduce: neither figure


def test_crowded_tensor_parallel_collectives_are_charged_at_the_compute_between_them():
    """On a crowded node a tp collective costs the crowded group figure at the layout's own compute between two
    collectives (a micro-batch's compute over its collectives); the gradient all-reduce the figure after a whole step."""
    table = {4: {2: [(0.0, 1000.0), (1e9, 1000.0 + 1e9)]}}  # 1 µs more per µs of compute between
    hardware = replace(ANY_HARDWARE, intra_node_gbps=1e9, intra_node_latency_us=1000.0, host_cores=2, crowded_latency_us={4: 6000.0},
                       crowded_group_latency_us=table)
    workload = Workload(devices_per_node=4, num_nodes=1, global_batch=8)
    tp = predict(profile(), Layout(2, 2, 1), workload, hardware)
    calls = profile().step(2).tp_collectives
    # Each collective: 1 ms plus the compute before it, the forward and backward's over the calls: together 1 ms per
    # call plus that compute once (ANY_HARDWARE's optimizer step costs next to nothing beside it).
    assert tp.compute_s > 0 and tp.tp_s - calls * 1e-3 == pytest.approx(tp.compute_s, rel=1e-3)
    flat = predict(profile(), Layout(2, 2, 1), workload, replace(hardware, crowded_group_latency_us={4: {2: [(0.0, 1000.0)]}}))
    assert flat.tp_s == pytest.approx(calls * 1e-3)
    # The gradient all-reduce among the 2 replicas: after a whole step's compute, the last point measured.
    assert flat.dp_s < tp.dp_s


def test_sharded_state_is_counted_in_fsdp2_whole_row_chunks():
    """FSDP2 cuts dim 0 as ``torch.chunk`` does: ⌈rows / shards⌉ whole rows to each of the first ranks, the rest to
    the last (or nothing). A 1/shards share undercounted the first rank of a small tensor over many ranks."""
    step = profile().step(1)
    name = next(iter(step.parameter_bytes))
    for rows, held in ((10, [3, 3, 3, 1]), (3, [1, 1, 1, 0]), (8, [2, 2, 2, 2])):
        chunked = replace(step, parameter_rows={name: rows})
        assert [chunked.shard_bytes({name: rows * 4.0}, [name], 4, index) for index in range(4)] == [4.0 * h for h in held]
    assert replace(step, parameter_rows={}).shard_bytes({name: 40.0}, [name], 4) == 10.0  # rows unknown: an even share
