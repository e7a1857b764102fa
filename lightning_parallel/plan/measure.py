"""``--measure``: run a few real steps of the best layouts on this machine and put them beside the prediction.

Each layout runs the training script (``recipes/train.py`` by default) as a fresh job with the planner's
overrides and the ScalingMonitor on; its ``scaling.json`` holds the measured means.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lightning_parallel.measure.environment import standalone_environment
from lightning_parallel.plan.planner import Plan

#: Settings --measure chooses itself; the user's overrides of them are dropped.
_CHOSEN_BY_MEASURE = ("strategy", "data.batch_size", "trainer.max_steps", "scaling_monitor", "hydra.run.dir")


def run_training(script: str | Path, overrides: list[str], run_dir: Path, cwd: Path | None = None, timeout: float = 1800) -> None:
    """Run ``script`` with Hydra ``overrides`` into ``run_dir`` (one thread per process unless OMP_NUM_THREADS says).

    Raises:
        RuntimeError: The job failed (its last output is quoted).
    """
    command = [sys.executable, str(script), *overrides, f"hydra.run.dir={run_dir}"]
    env = standalone_environment()  # a job of its own, even when a rank of another runs it
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(command, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def read_scaling(run_dir: Path) -> dict[str, Any]:
    """The ScalingMonitor's ``scaling.json`` of a finished run.

    Raises:
        RuntimeError: There is none (the monitor was off or not among the trainer's callbacks).
    """
    path = run_dir / "scaling.json"
    if not path.is_file():
        raise RuntimeError(f"No {path}: is the ScalingMonitor among the trainer's callbacks, and scaling_monitor=true?")
    return json.loads(path.read_text())


def measure_best(result: Plan, args: argparse.Namespace, console: Console) -> int:
    """Measure the ``args.measure_top`` best layouts that fit (single-node jobs only); print predicted vs measured."""
    if result.workload.num_nodes != 1:
        console.print("[red]--measure runs jobs on this machine: use trainer.num_nodes=1.[/red]")
        return 2
    chosen = [p for p in result.predictions if p.fits][: args.measure_top]
    table = Table(title=f"predicted vs measured · {args.measure_steps} steps each, means after the first")
    for column in ("layout", "step s pred", "step s meas", "pred / meas", "samples/s pred", "samples/s meas", "compute share pred", "compute share meas"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    with tempfile.TemporaryDirectory(prefix="lightning-parallel-measure-") as scratch:
        for index, prediction in enumerate(chosen):
            overrides = [
                *(o for o in args.overrides if not o.lstrip("+~").startswith(_CHOSEN_BY_MEASURE)),
                *prediction.layout.overrides(prediction.batch_size),
                f"trainer.max_steps={args.measure_steps}",
                "scaling_monitor=true",
            ]
            console.print(f"measuring {prediction.layout.describe()} ...")
            run_dir = Path(scratch) / f"run{index}"
            try:
                run_training(args.train_script, overrides, run_dir)
                measured = read_scaling(run_dir)["measured"]
            except RuntimeError as error:
                console.print(f"[red]{error}[/red]")
                return 1
            table.add_row(
                prediction.layout.describe(),
                f"{prediction.step_s:.4g}",
                f"{measured['step_s']:.4g}",
                f"{prediction.step_s / measured['step_s']:.2f}",
                f"{prediction.samples_per_s:.4g}",
                f"{measured['samples_per_s']:.4g}",
                f"{prediction.compute_share:.2f}",
                f"{measured['efficiency']:.2f}",
            )
    console.print(table)
    return 0
