"""Several fits in one set of processes, saving and resuming checkpoints: ``python -m tests.checkpoint_worker PLAN.json``.

Started under torchrun (the processes exist before Lightning looks), so each fit can use a different
layout of the same ranks. The plan is a list of runs; rank 0 writes every run's findings to ``result``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.harness import JobSpec, build


@dataclass
class Run:
    name: str
    strategy: str  # single | data | tensor | pipeline | hybrid (as JobSpec)
    steps: int  # max_steps: a resumed run counts the steps before the checkpoint too
    batch_size: int = 4  # per data-parallel rank
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    resume: str | None = None  # ckpt_path for fit
    # ModelCheckpoint(every_n_train_steps=checkpoint_every) into checkpoint_dir, named step=<n>.ckpt, all kept.
    checkpoint_every: int | None = None
    checkpoint_dir: str | None = None
    accumulate: int = 1
    model_kwargs: dict[str, Any] = field(default_factory=dict)  # JobSpec's n_layer, n_embd, ...


def run(plan: Run, devices: int) -> dict[str, Any]:
    spec = JobSpec(
        strategy=plan.strategy, devices=devices, steps=plan.steps, batch_size=plan.batch_size,
        accumulate=plan.accumulate, strategy_kwargs=plan.strategy_kwargs, **plan.model_kwargs,
    )
    model, data, trainer, recorder = build(spec)
    if plan.checkpoint_every is not None:
        # Saved during training, as users do: the data loader's position is part of the checkpoint then.
        trainer.callbacks.append(
            ModelCheckpoint(plan.checkpoint_dir, filename="{step}", every_n_train_steps=plan.checkpoint_every, save_top_k=-1)
        )
    trainer.fit(model, datamodule=data, ckpt_path=plan.resume)
    return {
        "step_losses": recorder.result["step_losses"],
        "final_state": recorder.states[-1] if recorder.states else None,
        "ema_params": recorder.result.get("ema_params"),  # model_kwargs ema=<decay>: the averaged parameters at the end
    }


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    results = {}
    for entry in spec["runs"]:
        plan = Run(**entry)
        results[plan.name] = run(plan, spec["devices"])
    if torch.distributed.get_rank() == 0:
        torch.save(results, spec["result"])
    # Leave together: a rank that exits while its peer's gloo threads still run can abort ("terminate called without
    # an active exception", seen in CI under test_periodic_sync), as tests/jobs_worker.py explains.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
