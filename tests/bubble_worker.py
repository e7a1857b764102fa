"""A 2-stage pipeline whose stages take a known time: ``python -m tests.bubble_worker OUT_DIR`` under torchrun.

Each stage is one layer that sleeps ``FORWARD_S`` in forward and ``BACKWARD_S`` in backward per
micro-batch, so the schedule's idle time is known: (p−1)/(m+p−1) of each batch for GPipe and 1F1B. The
layers cannot be traced (a trace would drop the sleeps): the pipeline slices the ``nn.Sequential`` instead. Rank 0 writes
each schedule's ScalingMonitor summary to ``OUT_DIR/<schedule>.json``, every rank's stage actions of the one measured
step (the one the timeline draws) to ``OUT_DIR/<schedule>_events.json``, and the monitor draws
``OUT_DIR/<schedule>/pipeline_timeline.png``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import lightning_parallel
from tests.regressor import GuardedLayer, RegressionData

FORWARD_S = 0.1
BACKWARD_S = 0.2
MICROBATCHES = 4
SCHEDULES = ("gpipe", "1f1b")


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_S)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(BACKWARD_S)
        return grad


class SleepyLayer(GuardedLayer):
    """The regressor's untraceable layer (torch.export would drop the sleeps), taking a known time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(super().forward(x))


class SleepyPipeline(L.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(SleepyLayer(width), SleepyLayer(width))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x).sum(dim=1, keepdim=True), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


#: Optimizer steps: one warm-up, then the one step the monitor measures and records the actions of.
STEPS = 2


def run(schedule: str, out: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The monitor's summary (rank 0; empty elsewhere) and every rank's recorded stage actions (by rank)."""
    L.seed_everything(0)
    monitor = lightning_parallel.ScalingMonitor(warmup_steps=1, output_dir=out / schedule)
    # The timeout only turns a hang into an error: rank 1 waits while rank 0 draws the timeline, which can be slow
    # on a loaded 2-core machine (rank 1 aborted there once, cause unconfirmed); the launch's own limit is 300 s.
    strategy = lightning_parallel.PipelineParallelStrategy(
        pipeline_parallel_size=2, schedule=schedule, microbatches=MICROBATCHES, timeout=240
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, precision="64-true", max_steps=STEPS, callbacks=[monitor],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(SleepyPipeline(), datamodule=RegressionData(batch_size=8))
    # The actions the timeline draws (the monitor's recorder keeps them; test instrumentation reads them there).
    events = [asdict(event) for event in monitor._pipeline.events]
    by_rank = [None] * trainer.world_size
    torch.distributed.all_gather_object(by_rank, events)
    return monitor.summary, by_rank


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    for name in SCHEDULES:
        summary, events = run(name, out_dir)
        if summary:  # rank 0
            (out_dir / f"{name}.json").write_text(json.dumps(summary, default=str))
            (out_dir / f"{name}_events.json").write_text(json.dumps(events))
        # Rank 0 draws the timeline at the end of fit; rank 1 waits here for it rather than in the next run's setup,
        # where it aborted twice (SIGABRT, the cause not captured) while rank 0 was drawing.
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
