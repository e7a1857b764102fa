"""Shared pieces of the benchmark scripts: a step timer and running one variant in fresh processes."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"


class StepTimer(L.Callback):
    """Wall time between consecutive training-batch ends; rank 0 writes ``extra`` + times to ``out``."""

    def __init__(self, out: Path, warmup: int, extra: dict[str, Any] | None = None) -> None:
        self.out, self.warmup, self.extra = out, warmup, extra or {}
        self.times: list[float] = []
        self.last = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.last = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            self.out.write_text(json.dumps({**self.extra, "step_times": self.times[self.warmup :], "world_size": trainer.world_size}))


class CommCounter(L.Callback):
    """Counts the collectives of one training step (forward, backward, optimizer) with torch's
    ``CommDebugMode`` (DTensor's functional collectives and c10d's), by op name."""

    def __init__(self, step: int) -> None:
        self.step, self.mode, self.counts = step, None, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.step:
            from torch.distributed.tensor.debug import CommDebugMode

            self.mode = CommDebugMode()
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.mode is not None and batch_idx == self.step:
            self.mode.__exit__(None, None, None)
            self.counts = {str(op).rsplit(".", 1)[-1]: n for op, n in self.mode.get_comm_counts().items()}


def run_worker_copies(script: Path, worker_args: list[str], outs: list[Path]) -> list[dict[str, Any]]:
    """Run ``len(outs)`` copies of ``script --worker ...`` at once (1 thread each); their JSON results."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # one core per process; Lightning keeps a value that is already set
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *worker_args, "--out", str(out)],
            cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for out in outs
    ]
    for proc in procs:
        _, stderr = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"{script.name} {' '.join(worker_args)} failed:\n{stderr[-4000:]}")
    return [json.loads(out.read_text()) for out in outs]


def median_step(result: dict[str, Any]) -> float:
    return statistics.median(result["step_times"])


@contextmanager
def scratch_dir() -> Iterator[Path]:
    """A folder for the workers' JSON results, removed afterwards whatever happens."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=RESULTS, prefix=".scratch-") as folder:
        yield Path(folder)
