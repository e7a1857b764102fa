"""A 1,024-rank layout dry-run on this machine: the real strategy and one step per simulated rank (fake process
group), every figure beside the planner's prediction for that rank (``python -m lightning_parallel.plan --simulate``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
#: pp 8 × dp 128 on 128 nodes of 8: a tiny-width, 16-layer GPT (two layers per stage), 8 micro-batches.
LAYOUT = ["strategy=hybrid", "trainer.devices=8", "trainer.num_nodes=128", "strategy.pipeline_parallel_size=8",
          "model.n_layer=16", "model.n_embd=32", "model.n_head=2", "data.block_size=32", "data.batch_size=16",
          "strategy.microbatches=8"]


#: dp 2 × tp 2 × pp 2 of the recipe GPT: tensor parallelism inside traced pipeline stages.
TP_IN_STAGES = ["strategy=hybrid", "trainer.devices=8", "strategy.tensor_parallel_size=2", "strategy.pipeline_parallel_size=2"]


def simulate(tmp_path: Path, *extra: str, layout: list[str] = LAYOUT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "lightning_parallel.plan", *layout, "--simulate", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_thousand_ranks_simulate_as_predicted(tmp_path):
    out = tmp_path / "simulation.json"
    proc = simulate(tmp_path, "--simulate-ranks", "0,512,1023", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 512, 1023]
    assert {r["world_size"] for r in ranks} == {1024}
    assert [r["coordinates"]["pp"] for r in ranks] == [0, 4, 7]
    assert ranks[-1]["coordinates"]["dp_replicate"] == 127
    for figures in ranks:
        pairs = figures["predicted_vs_simulated"]
        # Every pipeline position against its own prediction: state, gradients reduced, stage transfers.
        assert {"parameters", "gradients", "optimizer", "dp comm", "pp comm"} <= set(pairs)
        for name, (predicted, simulated) in pairs.items():
            assert predicted == pytest.approx(simulated, rel=0.10), (figures["rank"], name)
        # Only this rank's stage is held: about an eighth of the model's state.
        assert 0 < figures["state_bytes"]["parameters"] < 0.25 * report["prediction"]["memory_by_pipeline_rank"][0]["parameters"] * 8
        assert figures["peak_rss_bytes"] < 4 * 2**30
    # The first stage sends each micro-batch's activations on and received their gradients: real transfers.
    assert ranks[0]["pipeline"]["sends"] >= 8 and ranks[0]["comm_bytes"]["pp"] > 0
    assert ranks[0]["comm_bytes"]["dp"] == pytest.approx(ranks[0]["state_bytes"]["gradients"], rel=0.01)
    # A middle stage sends both ways (activations on, gradients back): twice the first and the last stage's bytes.
    assert ranks[1]["comm_bytes"]["pp"] == pytest.approx(2 * ranks[0]["comm_bytes"]["pp"], rel=0.01)
    assert ranks[2]["comm_bytes"]["pp"] == pytest.approx(ranks[0]["comm_bytes"]["pp"], rel=0.01)


def test_a_rank_outside_the_layout_is_refused_before_anything_runs(tmp_path):
    proc = simulate(tmp_path, "--simulate-ranks", "0,1024")
    assert proc.returncode == 2
    assert "ranks must lie in 0..1023" in proc.stdout + proc.stderr


def test_tensor_parallel_stages_hand_collectives_what_the_planner_predicts(tmp_path):
    """Row-wise outputs inside traced stages are reduced where computed, as eager TP does: a norm behind one no longer
    all-reduces its saved partial input again in backward (it did: 11 activation all-reduces per micro-batch, not 8)."""
    out = tmp_path / "simulation.json"
    proc = simulate(tmp_path, "--simulate-ranks", "0", "--json", str(out), layout=TP_IN_STAGES)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (figures,) = json.loads(out.read_text())["ranks"]
    pairs = figures["predicted_vs_simulated"]
    assert "tp comm" in pairs
    for name, (predicted, simulated) in pairs.items():
        assert predicted == pytest.approx(simulated, rel=0.10), name


def test_sharded_data_parallel_collectives_are_counted_as_predicted(tmp_path):
    """FSDP2's all-gathers and reduce-scatters are counted (through its hooks for custom collectives): two gathers of
    the parameters and one reduce-scatter of the gradients per step, as the planner predicts."""
    out = tmp_path / "simulation.json"
    layout = ["strategy=hybrid", "trainer.devices=4", "strategy.data_parallel_mode=shard"]
    proc = simulate(tmp_path, "--simulate-ranks", "0", "--json", str(out), layout=layout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (figures,) = json.loads(out.read_text())["ranks"]
    predicted, simulated = figures["predicted_vs_simulated"]["dp comm"]
    assert simulated == pytest.approx(predicted, rel=0.10)
    assert simulated == pytest.approx(3 * 4 * figures["state_bytes"]["parameters"], rel=0.05)  # 3 × the whole model


def test_replicated_data_parallel_dry_runs_with_its_gradient_all_reduce_counted(tmp_path):
    """DDP's communication hook reads its all-reduce's result, which the fake backend's work does not carry (the dry
    run of plain data parallelism stopped with ``'NoneType' object is not subscriptable``)."""
    out = tmp_path / "simulation.json"
    proc = simulate(tmp_path, "--simulate-ranks", "0", "--json", str(out), layout=["strategy=data", "trainer.devices=4"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (figures,) = json.loads(out.read_text())["ranks"]
    predicted, simulated = figures["predicted_vs_simulated"]["dp comm"]
    assert simulated == pytest.approx(predicted, rel=0.10)
    assert simulated == pytest.approx(figures["state_bytes"]["parameters"], rel=0.05)  # one all-reduce of the gradients


#: dp 64 (shard) × cp 2 × tp 4 × pp 8 on 512 nodes of 8: the recipe GPT with 16 layers (issue 54's figures).
CP_IN_STAGES = ["strategy=hybrid", "trainer.devices=8", "trainer.num_nodes=512", "strategy.context_parallel_size=2",
                "strategy.tensor_parallel_size=4", "strategy.pipeline_parallel_size=8", "strategy.data_parallel_mode=shard",
                "model.n_layer=16", "strategy.microbatches=8", "data.batch_size=8"]


def test_context_parallel_figures_agree_with_the_planner_on_every_rank(tmp_path):
    """Under cp the planner counts a stage boundary's 1/cp of the sequence (it predicted 2.00× the pipeline bytes), the
    last stage's gather of the logits (0.80 of the context-parallel bytes there), and FSDP2's whole-row chunks over
    dp_shard × cp = 128 ranks (the first shard rank holds a whole row of a 32-row tensor: 0.60 of its parameters;
    rank 256, in the group's middle, 2.26× fewer)."""
    out = tmp_path / "simulation.json"
    proc = simulate(tmp_path, "--simulate-ranks", "256,4095", "--json", str(out), layout=CP_IN_STAGES)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    first_stage, last_stage = json.loads(out.read_text())["ranks"]
    assert (first_stage["coordinates"]["pp"], last_stage["coordinates"]["pp"]) == (0, 7)
    for figures in (first_stage, last_stage):
        pairs = figures["predicted_vs_simulated"]
        assert {"parameters", "optimizer", "dp comm", "tp comm", "cp comm", "pp comm"} <= set(pairs)
        for name, (predicted, simulated) in pairs.items():
            assert predicted == pytest.approx(simulated, rel=0.10), (figures["rank"], name)
    # The last stage gathers the logits over cp beside the ring: it hands more to cp collectives than the first.
    assert last_stage["comm_bytes"]["cp"] > first_stage["comm_bytes"]["cp"]
