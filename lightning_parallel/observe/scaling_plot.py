"""Scaling efficiency of a sweep: ``python -m lightning_parallel.observe.scaling_plot SWEEP_DIR [--out PNG]``.

Reads every ``scaling.json`` the ScalingMonitor wrote under ``SWEEP_DIR`` (a Hydra multirun directory),
e.g. after::

    python recipes/train.py -m strategy=data trainer.devices=1,2,4,8 trainer.max_steps=30
    python -m lightning_parallel.observe.scaling_plot multirun/2026-11-30/10-00-00

Measured efficiency = samples/s / (devices × samples/s of the one-device run in the sweep); the predicted
curve is the planner's speedup / devices for each run's layout. Runs are grouped by the dimensions they
split (dp, tp, pp, dp×tp, ...); the one-device run starts every series.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_parallel.observe.plots import render_scaling


def series_name(layout: dict[str, Any]) -> str:
    """``dp``, ``tp × pp``, ...: the dimensions a layout splits (``single`` for none)."""
    split = [dim for dim in ("dp", "tp", "pp") if layout.get(dim, 1) > 1]
    return " × ".join(split) or "single"


def scaling_points(runs: Iterable[dict[str, Any]]) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[tuple[int, float]]]]:
    """(measured, predicted) efficiency points per series from ScalingMonitor summaries.

    Raises:
        ValueError: No one-device run to measure speedup against.
    """
    runs = [r for r in runs if r.get("measured")]
    singles = [r for r in runs if r["world_size"] == 1]
    if not singles:
        raise ValueError("The sweep has no one-device run (trainer.devices=1) to measure speedup against; add one.")
    base = singles[0]["measured"]["samples_per_s"]
    measured: dict[str, list[tuple[int, float]]] = {}
    predicted: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        if run["world_size"] == 1:
            continue
        layout = run["predicted"]["layout"] if run.get("predicted") else {"dp": run["world_size"]}
        name = series_name(layout)
        measured.setdefault(name, [(1, 1.0)]).append((run["world_size"], run["measured"]["samples_per_s"] / (run["world_size"] * base)))
        if run.get("predicted"):
            predicted.setdefault(name, [(1, 1.0)]).append((run["world_size"], run["predicted"]["efficiency"]))
    return measured, predicted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_parallel.observe.scaling_plot", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="directory holding the runs' scaling.json files (searched recursively)")
    parser.add_argument("--out", type=Path, help="PNG to write (default: SWEEP_DIR/scaling.png)")
    args = parser.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in sorted(args.sweep_dir.rglob("scaling.json"))]
    if not runs:
        print(f"No scaling.json under {args.sweep_dir}: run the sweep with the ScalingMonitor on (scaling_monitor=true).", file=sys.stderr)
        return 2
    try:
        measured, predicted = scaling_points(runs)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    path = render_scaling(measured, predicted, args.out or args.sweep_dir / "scaling.png", f"scaling efficiency · {args.sweep_dir.name}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
