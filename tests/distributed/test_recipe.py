"""The README's main command runs: recipes/train.py under Hydra, with the data-parallel strategy."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_parallel.observe.utilization import check_mfu

from tests.harness import REPO_ROOT, launch_environment

pytestmark = pytest.mark.distributed

SMALL = [
    "trainer.max_steps=3",
    "checkpoint.every_n_train_steps=3",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "data.max_chars=50000",
    "data.batch_size=4",
    "model.n_layer=1",
    "model.n_embd=32",
]


def run_recipe(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = launch_environment()
    proc = subprocess.run(
        [sys.executable, "recipes/train.py", *args], check=False, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def assert_first_screen_is_the_users(output: str) -> None:
    """None of the third-party noise issue 30 found on `make train`'s first screen (from any rank)."""
    for noise in ("set_vital", "LeafSpec", "Epoch 0/-2", "Total FLOPs: 0", "litlogger"):
        assert noise not in output, f"{noise!r} on the first screen:\n{output[-6000:]}"
    assert "FLOPs ┃" not in output  # no per-module FLOPs column: Lightning's read 0 on every row
    flops = re.search(r"Training FLOPs per sample: ([\d.]+) ([KMGT]?)", output)
    assert flops and float(flops.group(1)) > 0, output[-6000:]  # the planner's count instead
    assert re.search(r"Steps · epoch \d+ .* 3/3", output)  # the progress bar counts the step budget


def test_default_command_prints_only_what_is_the_users(tmp_path):
    """`make train`'s command (the defaults: GPT, one CPU process), three steps."""
    proc = run_recipe(["trainer.max_steps=3", f"hydra.run.dir={tmp_path}"])
    output = proc.stdout + proc.stderr
    assert "lightning_parallel summary: 3 steps" in output
    assert_first_screen_is_the_users(output)


def metric_rows(run_dir: Path) -> list[dict[str, str]]:
    (metrics,) = run_dir.glob("csv/version_*/metrics.csv")
    with metrics.open() as handle:
        return list(csv.DictReader(handle))


def test_train_recipe_with_data_parallel_strategy(tmp_path):
    proc = run_recipe(["strategy=data", "trainer.devices=2", *SMALL, f"hydra.run.dir={tmp_path}"])
    output = proc.stdout + proc.stderr
    assert "layout dp=2 × tp=1 × pp=1 on gloo" in output
    assert "lightning_parallel summary: 3 steps" in output and "over 2 replica(s)" in output
    rows = metric_rows(tmp_path)
    assert any(row.get("train/loss") for row in rows)
    assert any(row.get("val/loss") for row in rows)
    # Rank 1 re-ran the same job (its log sits beside rank 0's), and only rank 0 wrote the config.
    assert (tmp_path / "train_rank1.log").exists()
    assert (tmp_path / ".hydra" / "config.yaml").exists()
    assert (tmp_path / "checkpoints" / "last.ckpt" / "meta.pt").exists()  # sharded, written at the last step
    # The ScalingMonitor is on by default: measured next to the planner's prediction for dp=2 on cpu_local.
    assert "ScalingMonitor · dp=2 × tp=1 × pp=1" in output
    scaling = json.loads((tmp_path / "scaling.json").read_text())
    assert scaling["measured"]["steps"] == 2 and scaling["predicted"]["layout"]["dp"] == 2
    # MFU against this CPU's measured fp32 peak, and tokens/s, in scaling.json, the CSV log and the summary line.
    measured = scaling["measured"]
    check_mfu(measured["mfu"], "recipe dp=2")
    assert measured["mfu"] > 0 and measured["mfu_dtype"] == "fp32" and measured["peak_measured"]
    assert measured["tokens_per_s"] == pytest.approx(measured["samples_per_s"] * 64)  # data.block_size=64
    assert any(row.get("scaling/mfu") for row in rows) and any(row.get("scaling/tokens_per_s") for row in rows)
    assert "tokens/s over 2 replica(s) · MFU" in output and "(measured peak)" in output
    assert_first_screen_is_the_users(output)  # rank 1 (a child process) adds no warnings either

    # The same run, resumed under another layout from its newest checkpoint, trains on to step 5 (one replica:
    # twice the per-replica batch keeps the global batch, which a resume must).
    resumed = run_recipe(
        ["strategy=tensor", "trainer.devices=2", *SMALL, "data.batch_size=8", "trainer.max_steps=5", "ckpt_path=last",
         f"hydra.run.dir={tmp_path}"]
    )
    output = resumed.stdout + resumed.stderr
    assert f"ckpt_path=last: resuming from {tmp_path / 'checkpoints'}" in output
    assert "Restored all states from the checkpoint" in output
    assert "lightning_parallel summary: 2 steps" in output


def test_multirun_sweep_runs_each_job_once(tmp_path):
    proc = run_recipe(
        ["-m", "strategy=data", "trainer.devices=1,2", *SMALL, f"hydra.sweep.dir={tmp_path}"], timeout=400
    )
    output = proc.stdout + proc.stderr
    assert output.count("lightning_parallel summary: 3 steps") == 2
    assert "over 1 replica(s)" in output and "over 2 replica(s)" in output
    for job in ("0", "1"):
        assert any(row.get("train/loss") for row in metric_rows(tmp_path / job))


def test_train_recipe_with_pipeline_experiment(tmp_path):
    small = [arg for arg in SMALL if not arg.startswith(("model.n_layer", "data.batch_size"))]
    proc = run_recipe(["experiment=gpt_pp2", *small, "model.n_layer=4", "data.batch_size=8", f"hydra.run.dir={tmp_path}"])
    output = proc.stdout + proc.stderr
    assert "layout dp=1 × tp=1 × pp=2 on gloo" in output
    assert "pipeline of GPTLightningModule in 4 stages over pp=2" in output and "schedule=interleaved_1f1b" in output
    assert "lightning_parallel summary: 3 steps" in output
    # The monitor drew one step of the pipeline.
    assert (tmp_path / "pipeline_timeline.png").read_bytes().startswith(b"\x89PNG")
    # The loss is computed on the last stage (rank 1) but logged by rank 0, which writes the metrics.
    rows = metric_rows(tmp_path)
    assert any(row.get("train/loss") for row in rows)
    assert any(row.get("val/loss") for row in rows)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_node_launch_with_torchrun_agents(tmp_path):
    """Two torchrun agents (one per simulated node, 2 processes each) meet at a localhost rendezvous and run
    the unchanged recipe: dp=2 replicas × tp=2, each TP pair inside one node."""
    env = launch_environment()
    port = free_port()
    recipe = [
        "recipes/train.py", "strategy=hybrid", "strategy.tensor_parallel_size=2", "trainer.devices=2", "trainer.num_nodes=2",
        *SMALL, f"hydra.run.dir={tmp_path}",
    ]
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes", *recipe],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        for _ in range(2)
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=300)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
    assert all(agent.returncode == 0 for agent in agents), "\n\n".join(o[-4000:] for o in outputs)
    output = "\n".join(outputs)
    assert "layout dp=2 × tp=2 × pp=1 on gloo" in output
    assert "lightning_parallel summary: 3 steps" in output and "over 2 replica(s)" in output
    assert any(row.get("train/loss") for row in metric_rows(tmp_path))


def test_hybrid_sim_experiment_runs_here(tmp_path):
    """The 64-GPU experiment's shape at CPU size: 8 processes, dp=2 × tp=2 × pp=2, checkpointed blocks."""
    # Two steps, no validation or checkpoint (the 8-rank equivalence test covers those): this checks the config.
    small = [arg for arg in SMALL if not arg.startswith(("model.", "data.batch_size", "trainer.max_steps", "checkpoint."))]
    proc = run_recipe(
        ["experiment=hybrid_sim", *small, "trainer.max_steps=2", "trainer.limit_val_batches=0",
         "checkpoint.every_n_train_steps=1000", "scaling_monitor=false", f"hydra.run.dir={tmp_path}"],
        timeout=400,
    )
    output = proc.stdout + proc.stderr
    assert "layout dp=2 × tp=2 × pp=2 on gloo" in output
    assert "tensor-parallel plan over tp=2 inside each stage" in output
    assert "activation checkpointing of model.blocks.0, model.blocks.1" in output
    assert "lightning_parallel summary: 2 steps" in output
    assert any(row.get("train/loss") for row in metric_rows(tmp_path))
