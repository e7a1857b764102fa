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


#: Collectives by ``namespace::name`` as torch's ``CommDebugMode`` counts them (its ``comm_registry`` and
#: ``c10d_collective_ops``): the functional ones (DTensor's, autograd-aware or not) and c10d's in-place ones.
#: Waits, barriers and point-to-point sends are not collectives here, as there.
_FUNCTIONAL = ("all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
               "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast")
_C10D = ("_allgather_base_", "_reduce_scatter_base_", "allgather_", "allgather_coalesced_",
         "allgather_into_tensor_coalesced_", "allreduce_", "allreduce_coalesced_", "alltoall_", "alltoall_base_",
         "broadcast_", "gather_", "scatter_", "reduce_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_")
COLLECTIVES = frozenset(
    [f"_c10d_functional::{n}" for n in _FUNCTIONAL] + [f"_c10d_functional_autograd::{n}" for n in _FUNCTIONAL]
    + [f"c10d::{n}" for n in _C10D]
)


def collective_count_mode():
    """A dispatch mode that counts collectives by op name (``mode.counts``), like ``CommDebugMode.get_comm_counts``.

    ``CommDebugMode`` itself also runs a module tracker, which (torch 2.13) registers one more forward hook on a
    module each time the module is called and pops its parent stack once per hook: a module called twice in one
    step (transformers' hub-kernel ``apply_rotary_pos_emb``, one module shared by every layer; an expert block
    called through a hook) empties the stack and raises ``IndexError: list index out of range`` inside the
    model's forward. Only the counts are wanted here, so this mode counts and tracks nothing else.
    """
    from collections import Counter

    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCountMode(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor turn the op into local ops and collectives, then count those
            name = func.name().split(".", 1)[0]  # "ns::op.overload" -> "ns::op"
            if name in COLLECTIVES:
                self.counts[name.split("::", 1)[1]] += 1
            return func(*args, **(kwargs or {}))

    return CollectiveCountMode()


class CommCounter(L.Callback):
    """Counts the collectives of one training step (forward, backward, optimizer) by op name: DTensor's
    functional collectives and c10d's (see :func:`collective_count_mode`)."""

    def __init__(self, step: int) -> None:
        self.step, self.mode, self.counts = step, None, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.step:
            self.mode = collective_count_mode()
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.mode is not None and batch_idx == self.step:
            self.mode.__exit__(None, None, None)
            self.counts = dict(self.mode.counts)


#: Where worker runs go instead of fresh processes (``benchmarks/smoke.py`` sets its pool of 2 ranks started once).
_pool: Any = None


def set_worker_pool(pool: Any) -> None:
    """Send :func:`run_worker_copies` to ``pool`` (its ``run(script, argv, ranks)``), or back to fresh processes (None)."""
    global _pool
    _pool = pool


def run_worker_copies(script: Path, worker_args: list[str], outs: list[Path], ranks: int = 2) -> list[dict[str, Any]]:
    """Run ``len(outs)`` copies of ``script --worker ...`` at once (1 thread each); their JSON results.

    ``ranks`` is how many processes one copy trains on (its Trainer's ``devices``): a smoke run's pool (see
    :func:`set_worker_pool`) runs one-process copies in this process and 2-rank ones in its launch, one after another.
    """
    if _pool is not None:
        for out in outs:
            _pool.run(script, [*worker_args, "--out", str(out)], ranks)
        return [json.loads(out.read_text()) for out in outs]
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
def scratch_dir(parent: Path = RESULTS) -> Iterator[Path]:
    """A folder under ``parent`` for the workers' JSON results, removed afterwards whatever happens."""
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=".scratch-") as folder:
        yield Path(folder)
