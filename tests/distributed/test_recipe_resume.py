"""The main recipe resumed from its own checkpoints goes on as if never interrupted, under every layout.

Exactly the commands of docs/checkpoints.md (Hydra, the ``chars`` data module's ``StatefulDataLoader`` with shuffling,
Lightning's injected distributed sampler, ``ckpt_path=last``), on a corpus so small that an epoch is three
steps: checkpoints every two steps fall mid-epoch (step 2, 4) and at an epoch's end (step 6), so the
resumed runs start mid-epoch and at an epoch boundary, and cross an epoch boundary.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from tests.distributed.test_recipe import run_recipe

pytestmark = pytest.mark.distributed

TINY = [
    "checkpoint.every_n_train_steps=2",
    "checkpoint.save_top_k=-1",
    "trainer.log_every_n_steps=1",
    "trainer.limit_val_batches=0",
    "trainer.precision=64-true",
    "scaling_monitor=false",
    # 430 characters: 24 training blocks of 16 tokens = 3 steps of 8 samples per epoch.
    "data.max_chars=430",
    "data.block_size=16",
    "model.n_layer=2",
    "model.n_embd=16",
    "model.n_head=2",
]

LAYOUTS = {
    # Lightning's own SingleDeviceStrategy keeps no random streams in its checkpoints: no dropout there.
    # and it restores a checkpoint before converting the module to float64 (rounding it to float32): float32 here.
    "single": ["strategy=single", "data.batch_size=8", "model.dropout=0.0", "trainer.precision=32-true"],
    "data": ["strategy=data", "trainer.devices=2", "data.batch_size=4", "model.dropout=0.1"],
    "tensor": ["strategy=tensor", "trainer.devices=2", "data.batch_size=8", "model.dropout=0.1"],
    "pipeline": ["strategy=pipeline", "trainer.devices=2", "data.batch_size=8", "model.dropout=0.1"],
    "hybrid": ["strategy=hybrid", "strategy.tensor_parallel_size=2", "trainer.devices=4", "data.batch_size=4", "model.dropout=0.1"],
}


def train_losses(run_dir: Path) -> dict[int, float]:
    """``train/loss`` by step from every CSV log of a run directory (a resumed run adds a version)."""
    losses: dict[int, float] = {}
    for version in sorted(run_dir.glob("csv/version_*")):
        with (version / "metrics.csv").open() as handle:
            rows = list(csv.DictReader(handle))
        for row in rows:
            if row.get("train/loss"):
                losses[int(row["step"])] = float(row["train/loss"])
    return losses


def assert_same_losses(expected: dict[int, float], found: dict[int, float], steps: range, rel: float) -> None:
    missing = [step for step in steps if step not in found]
    assert not missing, f"no train/loss logged for steps {missing}"
    worst = max(abs(found[s] - expected[s]) / abs(expected[s]) for s in steps)
    assert worst <= rel, {s: (expected[s], found[s]) for s in steps}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resumed_recipe_matches_uninterrupted_run(tmp_path, layout):
    args = [*TINY, *LAYOUTS[layout]]
    whole, stopped, from_step = tmp_path / "whole", tmp_path / "stopped", tmp_path / "from_step"
    run_recipe([*args, "trainer.max_steps=8", f"hydra.run.dir={whole}"])
    reference = train_losses(whole)
    assert sorted(reference) == list(range(8))

    # Stopped at step 6 (an epoch's end), resumed with ckpt_path=last: starts a new epoch.
    run_recipe([*args, "trainer.max_steps=6", f"hydra.run.dir={stopped}"])
    resumed = run_recipe([*args, "trainer.max_steps=8", "ckpt_path=last", f"hydra.run.dir={stopped}"])
    assert f"resuming from {stopped / 'checkpoints' / 'last.ckpt'}" in resumed.stdout + resumed.stderr
    assert_same_losses(reference, train_losses(stopped), range(8), rel=0.0)

    # From the uninterrupted run's step=2 checkpoint (mid-epoch), into a new run dir: crosses two epoch ends.
    checkpoint = whole / "checkpoints" / "step=2.ckpt"
    run_recipe([*args, "trainer.max_steps=8", f"ckpt_path='{checkpoint}'", f"hydra.run.dir={from_step}"])
    assert_same_losses(reference, train_losses(from_step), range(2, 8), rel=0.0)

    # Bitwise: after step 8 both resumed runs hold exactly the uninterrupted run's weights and optimizer state.
    expected = final_state(whole)
    for resumed_dir in (stopped, from_step):
        found = final_state(resumed_dir)
        assert found.keys() == expected.keys()
        unequal = [name for name, value in expected.items() if not torch.equal(found[name], value)]
        assert not unequal, f"{resumed_dir.name}: not bitwise equal to the uninterrupted run: {unequal}"


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a run's ``last.ckpt`` (weights, and the optimizer's moments by parameter), by name."""
    from lightning_parallel import ParallelCheckpointIO

    checkpoint = ParallelCheckpointIO().load_checkpoint(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 8
    tensors = {f"weights/{name}": value for name, value in checkpoint["state_dict"].items() if isinstance(value, torch.Tensor)}
    for index, optimizer in enumerate(checkpoint["optimizer_states"]):
        for key, entry in optimizer["state"].items():
            tensors.update({f"optimizer{index}/{key}/{k}": v for k, v in entry.items() if isinstance(v, torch.Tensor)})
    assert len(tensors) > len(checkpoint["state_dict"])  # the optimizer's state is there too
    return tensors


# Without dropout: each layout has its own per-rank random streams.
DATA_PARALLEL = [*TINY, "model.dropout=0.0", "strategy=data", "trainer.max_steps=8"]


@pytest.fixture(scope="module")
def data_parallel_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted dp=2 × 4 run, 8 steps: the run the two cross-layout resumes below start from."""
    whole = tmp_path_factory.mktemp("dp2")
    run_recipe([*DATA_PARALLEL, "trainer.devices=2", "data.batch_size=4", f"hydra.run.dir={whole}"])
    return whole


def test_resume_under_another_layout_keeps_the_data_order(tmp_path, data_parallel_run):
    """A dp=2 run's mid-epoch checkpoint resumed under tp=2 (one replica with the same global batch of 8)."""
    whole, moved = data_parallel_run, tmp_path / "tp2"
    checkpoint = whole / "checkpoints" / "step=4.ckpt"
    run_recipe(
        [*TINY, "model.dropout=0.0", "strategy=tensor", "trainer.devices=2", "data.batch_size=8", "trainer.max_steps=8",
         f"ckpt_path='{checkpoint}'", f"hydra.run.dir={moved}"]
    )
    assert_same_losses(train_losses(whole), train_losses(moved), range(4, 8), rel=1e-6)


def test_resume_onto_fewer_replicas_keeps_the_global_batch_or_refuses(tmp_path, data_parallel_run):
    """dp=2 × 4 samples, resumed on one process (a restart that got fewer ranks back): × 4 is refused (each step
    would average half the samples); × 8 goes on as the dp=2 run did."""
    import subprocess
    import sys

    from lightning_parallel import ParallelCheckpointIO
    from tests.harness import REPO_ROOT, launch_environment

    common = DATA_PARALLEL
    whole, refused, kept = data_parallel_run, tmp_path / "refused", tmp_path / "kept"
    checkpoint = f"ckpt_path='{whole / 'checkpoints' / 'step=4.ckpt'}'"
    proc = subprocess.run(
        [sys.executable, "recipes/train.py", *common, "trainer.devices=1", "data.batch_size=4", checkpoint,
         f"hydra.run.dir={refused}"],
        cwd=REPO_ROOT, env=launch_environment(), capture_output=True, text=True, timeout=240, check=False,
    )
    assert proc.returncode != 0
    assert "trained with 8 samples per micro-batch (2 data-parallel replica(s) × 4)" in proc.stderr
    assert "Keep them: data.batch_size=8 (per replica) with trainer.accumulate_grad_batches=1" in proc.stderr
    run_recipe([*common, "trainer.devices=1", "data.batch_size=8", checkpoint, f"hydra.run.dir={kept}"])

    def weights(run_dir: Path) -> dict:
        state = ParallelCheckpointIO().load_checkpoint(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
        return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}

    expected, found = weights(whole), weights(kept)
    for name, value in expected.items():
        torch.testing.assert_close(found[name], value, rtol=1e-6, atol=1e-9, msg=name)
    assert_same_losses(train_losses(whole), train_losses(kept), range(4, 8), rel=1e-6)
