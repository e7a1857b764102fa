"""Checkpoints move between layouts: save under one, resume under another, train as if never interrupted.

Each layout trains the recipe GPT (float64) for 8 optimizer steps, a ModelCheckpoint saving at step 4.
Other layouts resume from those step-4 checkpoints: the losses of steps 5–8 and every parameter after step
8 must equal one process training 8 steps uninterrupted (1e-6); resuming under the layout that saved is
bitwise identical to its own uninterrupted run. Sharded (sync and background-written) and full
checkpoints, with and without gradient accumulation; a Mixture-of-Experts model resumed under another expert-parallel
size. Several fits share one torchrun job per world size.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import cache
from pathlib import Path

import pytest
import torch

from tests.checkpoint_worker import Run, run
from tests.harness import launch_module

pytestmark = pytest.mark.distributed

TOL = 1e-6
STEPS = 8
SAVED_AT = 4

#: Per-rank batch sizes keep the global batch at 4 samples per micro-batch.
LAYOUTS = {
    "single": {"strategy": "single", "batch_size": 4},
    "dp2": {"strategy": "data", "batch_size": 2},
    "dp4": {"strategy": "data", "batch_size": 1},
    "tp2": {"strategy": "tensor", "batch_size": 4},
    "pp2": {"strategy": "pipeline", "batch_size": 4},
    "dp2xtp2": {"strategy": "hybrid", "batch_size": 2, "strategy_kwargs": {"data_parallel_size": 2, "tensor_parallel_size": 2}},
    "dp2xpp2": {
        "strategy": "hybrid", "batch_size": 2,
        "strategy_kwargs": {"data_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 2},
    },
    # docs/checkpoints.md's first example: saved by dp=4, resumed as tp=2 × pp=2.
    "tp2xpp2": {
        "strategy": "hybrid", "batch_size": 4,
        "strategy_kwargs": {"data_parallel_size": 1, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 2},
    },
    # The recipe's Mixture-of-Experts GPT (4 experts per block): experts divided over 2 or 4 ranks, or replicated.
    "moe_single": {"strategy": "single", "batch_size": 4, "model_kwargs": {"model": "gpt_moe"}},
    "moe_dp4ep2": {"strategy": "hybrid", "batch_size": 1, "model_kwargs": {"model": "gpt_moe"},
                   "strategy_kwargs": {"data_parallel_size": 4, "expert_parallel_size": 2}},
    "moe_dp4ep4": {"strategy": "hybrid", "batch_size": 1, "model_kwargs": {"model": "gpt_moe"},
                   "strategy_kwargs": {"data_parallel_size": 4, "expert_parallel_size": 4}},
    "moe_dp4": {"strategy": "data", "batch_size": 1, "model_kwargs": {"model": "gpt_moe"}},
    # A hand-written MoE whose experts are an nn.ModuleList (each rank holds its own experts, by global name).
    "list_moe_single": {"strategy": "single", "batch_size": 4, "model_kwargs": {"model": "list_moe"}},
    "list_dp2ep2": {"strategy": "hybrid", "batch_size": 2, "model_kwargs": {"model": "list_moe"},
                    "strategy_kwargs": {"data_parallel_size": 2, "expert_parallel_size": 2}},
    "list_dp2": {"strategy": "data", "batch_size": 2, "model_kwargs": {"model": "list_moe"}},
}

#: Layouts that train and save at step 4 (how), per world size and accumulation.
SAVES = {
    # world size 2, no accumulation: sync sharded, background sharded, one full file
    "dp2": {},
    "tp2": {"async_save": True},
    "pp2": {"save_format": "full"},
    "list_dp2ep2": {},  # sharded: each rank writes its own experts
    # world size 4, accumulate 2
    "dp2xtp2": {},
    "dp4": {},
    "moe_dp4ep2": {},
}
#: (source, target) pairs resumed in each job; a pair with equal names is the bitwise same-layout check.
RESUMES_2 = [("single", "dp2"), ("dp2", "pp2"), ("pp2", "tp2"), ("tp2", "pp2"), ("tp2", "dp2"), ("dp2", "dp2"),
             ("list_dp2ep2", "list_dp2")]
RESUMES_4 = [("dp2xtp2", "dp2xpp2"), ("dp2xtp2", "dp4"), ("dp2xtp2", "dp2xtp2"), ("dp4", "tp2xpp2"),
             ("moe_dp4ep2", "moe_dp4ep4"), ("moe_dp4ep2", "moe_dp4")]
RESUMES_SINGLE = [("pp2", "single", 1), ("tp2", "single", 1), ("dp2xtp2", "single", 2), ("list_dp2ep2", "list_moe_single", 1)]


def layout_run(name: str, layout: str, accumulate: int, **extra) -> Run:
    spec = LAYOUTS[layout]
    kwargs = {**spec.get("strategy_kwargs", {}), **extra.pop("strategy_kwargs", {})}
    return Run(name=name, strategy=spec["strategy"], steps=STEPS, batch_size=spec["batch_size"],
               strategy_kwargs=kwargs, accumulate=accumulate, model_kwargs=spec.get("model_kwargs", {}), **extra)


def saving_run(layout: str, root: Path, accumulate: int) -> Run:
    return layout_run(layout, layout, accumulate, strategy_kwargs=SAVES.get(layout, {}),
                      checkpoint_every=SAVED_AT, checkpoint_dir=str(root / layout))


def checkpoint_of(root: Path, layout: str) -> str:
    return str(root / layout / f"step={SAVED_AT}.ckpt")


@cache
def reference(root: Path, accumulate: int, model: str = "gpt") -> dict:
    """One process, 8 uninterrupted steps; it also saves the single-device checkpoint at step 4."""
    single = "single" if model == "gpt" else f"{model.removeprefix('gpt_')}_single"
    return run(saving_run(single, root / f"acc{accumulate}", accumulate), devices=1)


def reference_of(root: Path, layout: str, accumulate: int) -> dict:
    """The uninterrupted single-device run of the model ``layout`` trains."""
    return reference(root, accumulate, LAYOUTS[layout].get("model_kwargs", {}).get("model", "gpt"))


@cache
def torchrun_job(root: Path, devices: int) -> dict:
    accumulate = 1 if devices == 2 else 2
    base = root / f"acc{accumulate}"
    reference(root, accumulate)  # the single-device checkpoint the job resumes from
    saves = [layout for layout in SAVES if (layout.startswith(("dp2x", "moe_dp4")) or layout == "dp4") == (devices == 4)]
    resumes = RESUMES_2 if devices == 2 else RESUMES_4
    runs = [saving_run(layout, base, accumulate) for layout in saves]
    runs += [layout_run(f"{a}->{b}", b, accumulate, resume=checkpoint_of(base, a)) for a, b in resumes]
    plan = {"devices": devices, "result": str(root / f"result{devices}.pt"), "runs": [asdict(r) for r in runs]}
    plan_file = root / f"plan{devices}.json"
    plan_file.write_text(json.dumps(plan))
    proc = launch_module(["tests.checkpoint_worker", str(plan_file)], timeout=420, nproc=devices)
    if proc.returncode != 0:
        raise AssertionError(f"job failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    return torch.load(plan["result"], weights_only=False)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


def assert_continues_reference(resumed: dict, ref: dict) -> None:
    torch.testing.assert_close(resumed["step_losses"], ref["step_losses"][SAVED_AT:], atol=TOL, rtol=0)
    for name, value in ref["final_state"].items():
        torch.testing.assert_close(resumed["final_state"][name], value, atol=TOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("devices", [2, 4])
def test_saving_layouts_train_like_single_device(root, devices):
    """The runs that save (sync, background, full) train exactly like one process; saving changes nothing."""
    results = torchrun_job(root, devices)
    for layout in SAVES:
        if layout in results:
            ref = reference_of(root, layout, 1 if devices == 2 else 2)
            torch.testing.assert_close(results[layout]["step_losses"], ref["step_losses"], atol=TOL, rtol=0)
            assert Path(checkpoint_of(root / f"acc{1 if devices == 2 else 2}", layout)).exists()


@pytest.mark.parametrize(("source", "target"), [p for p in RESUMES_2 if p[0] != p[1]])
def test_resume_across_layouts_two_ranks(root, source, target):
    """Also a MoE with nn.ModuleList experts saved divided over ep=2, resumed replicated (plain dp2)."""
    assert_continues_reference(torchrun_job(root, 2)[f"{source}->{target}"], reference_of(root, source, 1))


@pytest.mark.parametrize(("source", "target"), [p for p in RESUMES_4 if p[0] != p[1]])
def test_resume_across_layouts_four_ranks_with_accumulation(root, source, target):
    """Also a Mixture-of-Experts model saved with its experts divided over 2 ranks, resumed divided over 4, and
    replicated (expert parallelism's checkpoints hold every expert by its global index)."""
    assert_continues_reference(torchrun_job(root, 4)[f"{source}->{target}"], reference_of(root, source, 2))


@pytest.mark.parametrize(("source", "devices"), [("dp2", 2), ("dp2xtp2", 4)])
def test_same_layout_resume_is_bitwise_identical(root, source, devices):
    results = torchrun_job(root, devices)
    resumed, uninterrupted = results[f"{source}->{source}"], results[source]
    assert torch.equal(resumed["step_losses"], uninterrupted["step_losses"][SAVED_AT:])
    for name, value in uninterrupted["final_state"].items():
        assert torch.equal(resumed["final_state"][name], value), name


@pytest.mark.parametrize(("source", "target", "accumulate"), RESUMES_SINGLE)
def test_resume_on_one_device_from_any_layout(root, source, target, accumulate):
    """Lightning's own single-device strategy with ParallelCheckpointIO reads sharded and full checkpoints."""
    torchrun_job(root, 2 if accumulate == 1 else 4)
    base = root / f"acc{accumulate}"
    resumed = run(layout_run(f"{source}->{target}", target, accumulate, resume=checkpoint_of(base, source)), devices=1)
    assert_continues_reference(resumed, reference_of(root, source, accumulate))
