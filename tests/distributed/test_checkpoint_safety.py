"""Nothing a user saved is lost or half-loaded: kills mid-save, background saves and cleanup, bad checkpoints.

One rank in this process (the engine with ``devices=1``) unless a kill needs a process of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_parallel import training_job
from lightning_parallel.checkpoint import (
    checkpoint_format,
    is_complete,
    latest_checkpoint,
    read_whole,
)
from lightning_parallel.checkpoint.files import partial_path
from tests.checkpoint_worker import Run, run
from tests.harness import REPO_ROOT, JobSpec, build

pytestmark = pytest.mark.distributed


def train(tmp_path: Path, steps: int, every: int = 1, resume: str | None = None, **strategy) -> dict:
    with training_job():
        return run(Run(name="job", strategy="data", steps=steps, strategy_kwargs=strategy, resume=resume,
                       checkpoint_every=every, checkpoint_dir=str(tmp_path)), devices=1)


@pytest.mark.parametrize("save_format", ["sharded", "full"])
def test_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, save_format):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.kill_worker", save_format, str(tmp_path)], cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "hanging").exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-4000:]
            assert time.monotonic() < deadline, "the save never reached the point of the kill"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    previous, torn = tmp_path / "step=1.ckpt", tmp_path / "step=2.ckpt"
    assert partial_path(torn).exists() and not torn.exists()  # the torn write stayed under its hidden name
    assert not is_complete(partial_path(torn))
    assert latest_checkpoint(tmp_path) == previous
    assert checkpoint_format(previous) == save_format
    # Training resumes from it; the same name written again sweeps the leftover away.
    resumed = train(tmp_path, steps=3, resume=str(previous), save_format=save_format)
    assert len(resumed["step_losses"]) == 2
    assert torn.exists() and not partial_path(torn).exists()


class NeverWithoutCheckpoint(Callback):
    """Fails if, after the first save, the directory ever holds no complete checkpoint."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.observed = directory, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step > 1:
            self.observed.append(latest_checkpoint(self.directory))
            assert self.observed[-1] is not None, f"no complete checkpoint left at step {trainer.global_step}"


@pytest.mark.parametrize("save_format", ["sharded", "full"])
def test_background_save_with_top_k_cleanup_keeps_a_complete_checkpoint(tmp_path, monkeypatch, save_format):
    """save_top_k=1 removes the previous checkpoint only once the background save of the next is complete."""
    import torch.distributed.checkpoint.filesystem as dcp_files

    from lightning_parallel.strategies import checkpoint_files

    slow_dcp = dcp_files._FileSystemWriter.write_data
    slow_full = checkpoint_files.atomic_torch_save

    def slowly(write):
        def wrapped(*args, **kwargs):
            time.sleep(0.5)  # still writing when the next step starts
            return write(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(dcp_files._FileSystemWriter, "write_data", slowly(slow_dcp))
    monkeypatch.setattr(checkpoint_files, "atomic_torch_save", slowly(slow_full))
    watcher = NeverWithoutCheckpoint(tmp_path)
    with training_job():
        model, data, trainer, _ = build(
            JobSpec(strategy="data", devices=1, steps=4, strategy_kwargs={"async_save": True, "save_format": save_format})
        )
        trainer.callbacks += [ModelCheckpoint(tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=1), watcher]
        trainer.fit(model, datamodule=data)
    assert watcher.observed  # the watcher looked while saves were in flight
    # At exit the last background save was completed and the older ones cleaned up.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=4.ckpt"]
    assert (read_whole(tmp_path / "step=4.ckpt") if save_format == "sharded" else torch.load(tmp_path / "step=4.ckpt", weights_only=False))["global_step"] == 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A sharded and a full checkpoint of the test GPT at step 2."""
    root = tmp_path_factory.mktemp("saved")
    paths = {}
    for save_format in ("sharded", "full"):
        train(root / save_format, steps=2, every=2, save_format=save_format)
        paths[save_format] = root / save_format / "step=2.ckpt"
    return paths


@pytest.mark.parametrize("save_format", ["sharded", "full"])
@pytest.mark.parametrize(
    ("model_kwargs", "expected"),
    [
        ({"n_layer": 3}, r"missing \(16\) \['model\.blocks\.2\."),
        ({"n_layer": 1}, r"unexpected \(16\) \['model\.blocks\.1\."),
        ({"n_embd": 32}, r"shape mismatch \(\d+\) \['model\.tok_emb\.weight: \(128, 16\) in the checkpoint vs \(128, 32\)"),
    ],
)
def test_checkpoint_of_another_model_is_refused_before_anything_loads(saved, save_format, model_kwargs, expected):
    with training_job():
        model, data, trainer, _ = build(JobSpec(strategy="data", devices=1, steps=4, **model_kwargs))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(RuntimeError, match=expected) as error:
            trainer.fit(model, datamodule=data, ckpt_path=str(saved[save_format]))
    assert str(saved[save_format]) in str(error.value) and "strict_loading" in str(error.value)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k].to(before[k].dtype)) for k in before), "a refused checkpoint changed weights"


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("save_format", ["sharded", "full"])
def test_corrupt_checkpoint_fails_clearly(saved, tmp_path, save_format):
    source = saved[save_format]
    copy = tmp_path / source.name
    subprocess.run(["cp", "-r", str(source), str(copy)], check=True)
    truncate(max(copy.glob("*.distcp"), key=lambda p: p.stat().st_size) if copy.is_dir() else copy)
    with training_job():
        model, data, trainer, _ = build(JobSpec(strategy="data", devices=1, steps=4))
        with pytest.raises(RuntimeError, match="corrupt or incomplete"):
            trainer.fit(model, datamodule=data, ckpt_path=str(copy))


def test_unfinished_sharded_directory_is_not_a_checkpoint(saved, tmp_path):
    copy = tmp_path / "step=2.ckpt"
    subprocess.run(["cp", "-r", str(saved["sharded"]), str(copy)], check=True)
    (copy / "meta.pt").unlink()
    with pytest.raises(RuntimeError, match=r"not a complete sharded checkpoint \(it lacks meta\.pt\)"):
        read_whole(copy)
    assert latest_checkpoint(tmp_path) is None
