"""Nothing a user saved is lost or half-loaded: kills mid-save, background saves and cleanup, bad checkpoints.

One rank in this process (the engine with ``devices=1``) unless a kill needs a process of its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
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


class HeldWrites:
    """Background writes that wait until the test lets them finish: the write of ``step=<k>.ckpt`` starts and then
    waits for ``release(k)``, so while it waits that save is certainly in flight (no timing decides it)."""

    def __init__(self) -> None:
        self.gates: dict[int, threading.Event] = defaultdict(threading.Event)
        self.lock = threading.Lock()

    def gate(self, k: int) -> threading.Event:
        with self.lock:
            return self.gates[k]

    def held(self, write, path_of):
        def wrapped(*args, **kwargs):
            step = int(re.search(r"step=(\d+)", str(path_of(*args, **kwargs))).group(1))
            # A budget, not a threshold: a release that never comes fails the test instead of hanging it.
            assert self.gate(step).wait(timeout=300), f"the write of step {step} was never released"
            return write(*args, **kwargs)
        return wrapped

    def release(self, k: int) -> None:
        self.gate(k).set()

    def release_all(self) -> None:
        with self.lock:
            for k in range(max(self.gates, default=0) + 10):
                self.gates[k].set()


class WatchWhileWriting(Callback):
    """At each step's start, while the previous step's save is held in flight, the directory must still hold the save
    before it (complete); then that write is released."""

    def __init__(self, directory: Path, writes: HeldWrites) -> None:
        self.directory, self.writes, self.observed = directory, writes, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        k = trainer.global_step  # step k's save was issued at its end and is held
        if k >= 1:
            latest = latest_checkpoint(self.directory)
            self.observed.append((k, latest.name if latest is not None else None))
            self.writes.release(k)

    def on_train_end(self, trainer, pl_module) -> None:
        self.writes.release_all()  # the last save completes at teardown


@pytest.mark.parametrize("save_format", ["sharded", "full"])
def test_background_save_with_top_k_cleanup_keeps_a_complete_checkpoint(tmp_path, monkeypatch, save_format):
    """save_top_k=1 removes the previous checkpoint only once the background save of the next is complete: each save
    is held in flight until the next step has started and looked at the directory."""
    import torch.distributed.checkpoint.filesystem as dcp_files

    from lightning_parallel.strategies import checkpoint_files

    writes = HeldWrites()
    monkeypatch.setattr(dcp_files._FileSystemWriter, "write_data",
                        writes.held(dcp_files._FileSystemWriter.write_data, lambda writer, *a, **k: writer.path))
    monkeypatch.setattr(checkpoint_files, "atomic_torch_save",
                        writes.held(checkpoint_files.atomic_torch_save, lambda obj, path, *a, **k: path))
    watcher = WatchWhileWriting(tmp_path, writes)
    try:
        with training_job():
            model, data, trainer, _ = build(
                JobSpec(strategy="data", devices=1, steps=4, strategy_kwargs={"async_save": True, "save_format": save_format})
            )
            trainer.callbacks += [ModelCheckpoint(tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=1), watcher]
            trainer.fit(model, datamodule=data)
    finally:
        writes.release_all()
    # At steps 2, 3 and 4 the save of the step before was in flight, and the one before that was still there, whole.
    assert watcher.observed == [(1, None), (2, "step=1.ckpt"), (3, "step=2.ckpt")]
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
