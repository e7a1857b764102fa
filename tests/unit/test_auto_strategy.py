"""strategy=auto: the planner's choice for a module about to train, its refusals, and its Hydra config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

from lightning_parallel import AutoParallelStrategy
from lightning_parallel.plan.choose import choose_layout, meta_copy
from lightning_parallel.plan.config import configured_layout, workload_from_config
from lightning_parallel.plan.hardware import GIB, HardwareProfile
from lightning_parallel.plan.layouts import Layout, Workload
from lightning_parallel.plan.planner import PlanError
from tests.harness import JobSpec, local_hardware, make_model
from tests.planner_check import first_batch

ROOT = Path(__file__).resolve().parents[2]
SPEC = JobSpec(batch_size=8, n_layer=4)


def test_meta_copy_allocates_nothing_keeps_ties_and_leaves_the_module_alone():
    module = make_model(SPEC).double()
    module._trainer = object()  # a trainer attached to the module is not copied
    before = {name: p.clone() for name, p in module.named_parameters()}
    copy = meta_copy(module)
    assert all(p.is_meta for p in copy.parameters()) and all(b.is_meta for b in copy.buffers())
    assert copy.model.lm_head.weight is copy.model.tok_emb.weight
    assert copy._trainer is None
    assert all(torch.equal(p, before[name]) and not p.is_meta for name, p in module.named_parameters())
    assert [n for n, _ in copy.named_parameters()] == list(before)


def test_meta_copy_names_what_cannot_be_copied():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)
            self.stream = open(__file__)  # noqa: SIM115 — a file handle refuses deepcopy

    holder = Holder()
    try:
        with pytest.raises(TypeError, match=r"copy.deepcopy of it failed .*HybridParallelStrategy"):
            meta_copy(holder)
    finally:
        holder.stream.close()


def hand_profile(memory_bytes: float) -> HardwareProfile:
    """A device with ``memory_bytes`` of memory, all of it usable, 4 per node (no measured figures)."""
    return HardwareProfile(name="by_hand", device_memory_gib=memory_bytes / GIB, peak_tflops=1.0, achievable_fraction=1.0,
                           devices_per_node=4, intra_node_gbps=10.0, inter_node_gbps=1.0, memory_reserve_fraction=0.0)


def test_choice_follows_from_memory_and_traffic_derived_by_hand():
    """Four ranks, tp and pp pinned to 1: dp=4 in one of four ways (replicated or sharded, blocks recomputed or not).
    The answers follow without the planner: a replica holds the whole training state, 4 × 8 bytes per float64
    parameter (weights, gradients, AdamW's two moments); a shard holds a quarter of it plus, while it computes, the
    gathered weights (another quarter). Sharding adds the weights' all-gather to the gradients' traffic (which
    replication's all-reduce already is), and recomputing the blocks adds a forward: with memory for all, replicate
    without recomputation is fastest; with memory for 3/4 of the state, a replica cannot fit and the shard is chosen."""
    spec = JobSpec(batch_size=1, n_layer=4, n_embd=64)  # weights (6.7 MB of state) dwarf one sample's activations
    module, batch = make_model(spec).double(), first_batch(spec)
    whole_state = 4 * 8 * sum(p.numel() for p in module.parameters())
    workload, pinned = Workload(devices_per_node=4, num_nodes=1, global_batch=4), {"tp": 1, "pp": 1}

    roomy = choose_layout(module, batch, workload, hand_profile(2 * whole_state), pinned, dtype=torch.float64)
    assert roomy.layout == Layout(dp=4, tp=1, pp=1)
    assert roomy.report()[0].startswith("strategy=auto chose dp=4 × tp=1 × pp=1 for 4 ranks")
    tight = choose_layout(module, batch, workload, hand_profile(0.75 * whole_state), pinned, dtype=torch.float64)
    assert tight.layout == Layout(dp=4, tp=1, pp=1, data_parallel_mode="shard", shard_size=4)
    assert {p.layout.data_parallel_mode for p in tight.plan.predictions if not p.fits} == {"replicate"}
    # A strategy that cannot run the favourite gets the next that fits, and the log says what was skipped.
    no_replicas = choose_layout(module, batch, workload, hand_profile(2 * whole_state), pinned, dtype=torch.float64,
                                refuse=lambda layout: "not here" if layout.data_parallel_mode == "replicate" else None)
    assert no_replicas.layout == Layout(dp=4, tp=1, pp=1, data_parallel_mode="shard", shard_size=4)
    assert len(no_replicas.skipped) == 2 and all(s.endswith(": not here") for s in no_replicas.skipped)


def test_choice_on_this_machine_respects_pins_and_refusals():
    """On the measured profile, which layout wins depends on the machine; what holds anywhere: a pinned size is
    kept, a refused favourite is skipped for the next, and refusing every layout is an error."""
    module, batch = make_model(SPEC).double(), first_batch(SPEC)
    workload = Workload(devices_per_node=4, num_nodes=1, global_batch=32)
    hardware = local_hardware()
    choice = choose_layout(module, batch, workload, hardware, dtype=torch.float64)
    assert choice.report()[0].startswith(f"strategy=auto chose {choice.layout.describe()} for 4 ranks")
    favourite_pp = choice.layout.pp
    refused = choose_layout(module, batch, workload, hardware, dtype=torch.float64,
                            refuse=lambda layout: "not here" if layout.pp == favourite_pp else None)
    assert refused.layout.pp != favourite_pp
    assert refused.skipped and refused.skipped[0].endswith(": not here")
    with pytest.raises(PlanError, match="is refused"):
        choose_layout(module, batch, workload, hardware, dtype=torch.float64, refuse=lambda layout: "never")
    pinned = choose_layout(module, batch, workload, hardware, {"tp": 2}, dtype=torch.float64)
    assert pinned.layout.tp == 2


def test_bad_arguments_are_refused_early_by_name():
    hardware = local_hardware()
    with pytest.raises(TypeError, match="chooses microbatches, schedule itself.*pin="):
        AutoParallelStrategy(hardware=hardware, schedule="gpipe", microbatches=8)
    with pytest.raises(ValueError, match=r"pin.sp: only dp, cp, tp, pp, ep"):
        AutoParallelStrategy(hardware=hardware, pin={"sp": 2})
    with pytest.raises(ValueError, match=r"pin.tp=0 must be a positive int"):
        AutoParallelStrategy(hardware=hardware, pin={"tp": 0})
    with pytest.raises(ValueError, match=r"global_batch=-4"):
        AutoParallelStrategy(hardware=hardware, global_batch=-4)
    with pytest.raises(TypeError, match=r"hardware=None.*conf/hardware"):
        AutoParallelStrategy()
    # Options it passes on reach the engine's components.
    assert AutoParallelStrategy(hardware=hardware, plan={"model.blocks.*.mlp.fc_in": "colwise"}).tensor_parallel_config.plan


def test_hydra_strategy_auto_leaves_the_layout_to_the_planner():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["strategy=auto", "trainer.devices=4", "+strategy.pin.tp=2", "trainer.accumulate_grad_batches=2"])
        batch = compose("config", overrides=["strategy=auto", "trainer.devices=4", "strategy.global_batch=48"])
    strategy = AutoParallelStrategy(**{k: v for k, v in cfg.strategy.items() if k not in ("_target_", "_convert_")})
    assert strategy.pin == {"tp": 2} and strategy.hardware.name == "cpu_local"
    assert configured_layout(cfg) is None
    # The global batch stays data parallelism's over every rank, unless global_batch fixes it.
    assert workload_from_config(cfg).global_batch == cfg.data.batch_size * 4 * 2
    assert workload_from_config(batch).global_batch == 48


def test_plan_cli_shows_what_strategy_auto_would_choose(capsys):
    from lightning_parallel.plan.__main__ import main

    status = main(["strategy=auto", "trainer.devices=2", "+strategy.pin.pp=2", "model.n_layer=2", "--config-dir", str(ROOT / "conf")])
    out = capsys.readouterr().out
    assert status == 0
    assert "recommended: dp=1 × tp=1 × pp=2" in out and "(configured)" not in out
