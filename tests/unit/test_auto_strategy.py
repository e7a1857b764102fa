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
from lightning_parallel.plan.layouts import Workload
from lightning_parallel.plan.planner import PlanError, plan
from lightning_parallel.plan.profile import profile_model
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


def test_choice_is_the_planners_recommendation_and_the_strategy_can_refuse():
    module, batch = make_model(SPEC).double(), first_batch(SPEC)
    workload = Workload(devices_per_node=4, num_nodes=1, global_batch=32)
    hardware = local_hardware()
    choice = choose_layout(module, batch, workload, hardware, dtype=torch.float64)
    expected = plan(profile_model(lambda: make_model(SPEC), batch, (1, 2, 4), dtype=torch.float64), workload, hardware)
    assert choice.layout == expected.recommended.layout
    assert choice.report()[0].startswith(f"strategy=auto chose {choice.layout.describe()} for 4 ranks")
    # A strategy that cannot run the favourite gets the next one that fits, and the log says what was skipped (the
    # favourite's pipeline depth is refused: which one that is depends on the machine's measured figures).
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
