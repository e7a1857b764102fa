"""Fault drill: one rank SIGKILLed mid-run under ``torchrun --max-restarts 1`` costs the steps since the last
checkpoint, never the run — the job exits 0 by itself and ends with the uninterrupted run's losses and weights.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_parallel import ParallelCheckpointIO
from tests.distributed.test_recipe import free_port
from tests.distributed.test_recipe_resume import TINY, assert_same_losses, train_losses
from tests.harness import REPO_ROOT, launch_environment

pytestmark = pytest.mark.distributed

STEPS, KILL_AT = 8, 5  # checkpoints every 2 steps: the restart resumes from step 4 and redoes step 4

LAYOUTS = {
    "data": (2, ["strategy=data", "data.batch_size=4"]),
    "tensor": (2, ["strategy=tensor", "data.batch_size=8"]),
    "pipeline": (2, ["strategy=pipeline", "data.batch_size=8"]),
    "hybrid": (4, ["strategy=hybrid", "strategy.tensor_parallel_size=2", "data.batch_size=4"]),
}


def torchrun(run_dir: Path, devices: int, overrides: list[str], kill_at: int | None = None) -> subprocess.CompletedProcess:
    """The drill script under torchrun with one restart allowed (``kill_at``: SIGKILL rank 1 before that step)."""
    env = launch_environment()
    if kill_at is not None:
        env.update(FAULT_KILL_STEP=str(kill_at), FAULT_KILL_RANK="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={devices}", "--max-restarts=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "tests/fault_drill.py",
        *TINY, f"trainer.devices={devices}", f"trainer.max_steps={STEPS}", "model.dropout=0.1", "strategy.timeout=60",
        *overrides, f"hydra.run.dir={run_dir}",
    ]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    # The recipe's checkpoints hold its Hydra config (OmegaConf objects): read in full.
    checkpoint = ParallelCheckpointIO().load_checkpoint(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    return {name: value for name, value in checkpoint["state_dict"].items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_killed_rank_restarts_and_training_continues_exactly(layout, tmp_path):
    devices, overrides = LAYOUTS[layout]
    whole, drilled = tmp_path / "whole", tmp_path / "drilled"
    reference = torchrun(whole, devices, overrides)
    assert reference.returncode == 0, reference.stderr[-4000:]
    proc = torchrun(drilled, devices, overrides, kill_at=KILL_AT)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "exitcode: -9" in output  # the first attempt did lose a rank ...
    assert "Restart 1 of this job: resuming from its newest checkpoint" in output  # ... and the second resumed
    assert f"resuming from {drilled / 'checkpoints'}" in output
    # The restarted attempt logs steps 4 on (the killed one's unflushed log may hold nothing).
    assert_same_losses(train_losses(whole), train_losses(drilled), range(KILL_AT - 1, STEPS), rel=0.0)
    expected, found = final_weights(whole), final_weights(drilled)
    assert expected.keys() == found.keys()
    for name, value in expected.items():
        assert torch.equal(found[name], value), name
