"""``--simulate``: dry-run the configured layout as chosen ranks on this machine, beside the planner's prediction.

Each chosen rank runs ``python -m lightning_parallel.dry_run --rank R`` (the real strategy and one training step
on torch's fake process group, in a process of its own, see :mod:`lightning_parallel.dry_run`). Its real shards'
bytes and the bytes it handed to collectives are set beside what the cost model predicts for that rank's
pipeline position; a ratio outside 0.9–1.1 is marked: one of the two is wrong. Chosen by default: the first and
the last rank, and for each axis larger than one the rank in the middle of it (the others at 0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lightning_parallel.layout import AXES, ParallelLayout
from lightning_parallel.plan.cost import Prediction

#: predicted / simulated outside this band is a disagreement (a bug in the cost model or in the strategy).
AGREEMENT = (0.9, 1.1)
#: Bytes compared per rank: state held, and what the step hands to collectives (as the cost model predicts them
#: for the rank's pipeline position).
STATE = ("parameters", "gradients", "optimizer")
COMM = ("dp", "tp", "cp", "pp")


def chosen_ranks(layout: ParallelLayout, spec: str = "auto") -> list[int]:
    """Ranks to simulate: ``auto`` (first, last, the middle of each axis) or a comma-separated list.

    Raises:
        ValueError: A rank outside the layout, or a spec that is neither.
    """
    world = layout.world_size
    if spec != "auto":
        try:
            ranks = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"--simulate-ranks={spec!r}: give 'auto' or comma-separated ranks, e.g. 0,17,4095.") from None
        outside = [r for r in ranks if not 0 <= r < world]
        if outside or not ranks:
            raise ValueError(f"--simulate-ranks={spec!r}: ranks must lie in 0..{world - 1} (the layout {layout.describe()}).")
        return sorted(set(ranks))
    ranks = {0, world - 1}
    for axis in AXES:
        if layout.size(axis) > 1:
            ranks.add(layout.rank_of({a: (layout.size(a) // 2 if a == axis else 0) for a in AXES}))
    return sorted(ranks)


def run_rank(rank: int, overrides: Sequence[str], config_dir: Path, config_name: str, timeout: float = 600) -> dict[str, Any]:
    """Simulate one rank in a fresh process; its figures (see :func:`lightning_parallel.dry_run.simulate_rank`).

    Raises:
        RuntimeError: The simulated rank failed (its last output is quoted).
    """
    with tempfile.TemporaryDirectory(prefix="lightning-parallel-simulate-") as scratch:
        out = Path(scratch) / "rank.json"
        command = [sys.executable, "-m", "lightning_parallel.dry_run", "--rank", str(rank), "--config-dir", str(config_dir),
                   "--config-name", config_name, "--json", str(out), *overrides]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")}
        # Ranks are simulated one at a time: each may use every core (its step's matmuls are most of its time).
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        started = time.perf_counter()
        proc = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"simulating rank {rank} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        figures = json.loads(out.read_text())
        figures["process_s"] = time.perf_counter() - started
        return figures


def compare(figures: Mapping[str, Any], prediction: Prediction) -> dict[str, tuple[float, float]]:
    """``{quantity: (predicted, simulated)}`` for one simulated rank."""
    pp = figures["coordinates"]["pp"]
    memory = prediction.memory[pp]
    pairs = {name: (float(getattr(memory, name)), float(figures["state_bytes"][name])) for name in STATE}
    predicted_comm = prediction.comm_bytes_by_pp_rank[pp] if prediction.comm_bytes_by_pp_rank else prediction.comm_bytes
    for axis in COMM:
        simulated = float(figures["comm_bytes"][axis])
        if axis == "dp" and simulated == 0 and prediction.layout.dp > 1:
            continue  # HSDP's all-reduce between replicas goes through c10d directly: not counted (FSDP2's own collectives are)
        pairs[f"{axis} comm"] = (float(predicted_comm.get(axis, 0.0)), simulated)
    return pairs


def disagreements(pairs: Mapping[str, tuple[float, float]]) -> list[str]:
    """Quantities whose predicted / simulated ratio lies outside :data:`AGREEMENT` (both zero agrees)."""
    low, high = AGREEMENT
    out = []
    for name, (predicted, simulated) in pairs.items():
        if predicted == simulated == 0:
            continue
        if simulated == 0 or not low <= predicted / simulated <= high:
            out.append(name)
    return out


def print_simulation(results: Sequence[Mapping[str, Any]], predictions: Sequence[Prediction], console: Console) -> int:
    """One row per simulated rank (beside ``predictions``: each rank's own); returns how many quantities disagree."""
    table = Table(title=f"dry run of {results[0]['layout']} · {results[0]['world_size']} ranks · predicted / simulated bytes")
    for column in ("rank", "coordinates", *STATE, *(f"{a} comm" for a in COMM), "setup s", "process s", "peak RSS"):
        table.add_column(column, justify="left" if column in ("rank", "coordinates") else "right")
    bad = 0
    for figures, prediction in zip(results, predictions):
        pairs = compare(figures, prediction)
        wrong = set(disagreements(pairs))
        bad += len(wrong)
        cells = []
        for name in (*STATE, *(f"{a} comm" for a in COMM)):
            if name not in pairs:
                cells.append("not counted")  # only HSDP's all-reduce between replicas (see compare)
                continue
            predicted, simulated = pairs[name]
            ratio = f"{predicted / simulated:.2f}" if simulated else ("1.00" if predicted == 0 else "∞")
            text = f"{_bytes(simulated)} ({ratio})"
            cells.append(f"[red]{text}[/red]" if name in wrong else text)
        coordinates = " ".join(f"{axis}{figures['coordinates'][axis]}" for axis in AXES)
        table.add_row(str(figures["rank"]), coordinates, *cells, f"{figures['setup_s']:.1f}", f"{figures['process_s']:.1f}",
                      _bytes(figures["peak_rss_bytes"]))
    console.print(table)
    console.print("bytes as simulated (the rank's real shards; what it handed to collectives in one step), and "
                  "predicted / simulated in brackets (each rank against its own pipeline position's prediction).")
    if bad:
        console.print(f"[red]{bad} figure(s) disagree with the planner by more than 10%[/red] (red): a bug in the cost model or in the strategy.")
    return bad


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def simulate_configured(
    cfg: Any, overrides: Sequence[str], config_dir: Path, config_name: str, ranks: str, console: Console, json_path: str | None = None
) -> int:
    """Predict the configured layout, simulate the chosen ranks, print both (and write them to ``json_path``);
    exit status 1 on a disagreement."""
    from lightning_parallel.plan.config import (
        configured_layout,
        configured_strategy,
        hardware_from_config,
        profile_from_config,
        workload_from_config,
        world_of,
    )
    from lightning_parallel.plan.cost import predict, shard_index_of

    devices, nodes = world_of(cfg)
    strategy = configured_strategy(cfg)
    if not hasattr(strategy, "layout_for"):
        raise ValueError(f"--simulate runs lightning_parallel's strategies; strategy={type(strategy).__name__}.")
    planned = configured_layout(cfg)
    if planned is None:
        raise ValueError(
            "--simulate dry-runs a configured layout, and strategy=auto chooses its layout at launch: run the planner "
            "without --simulate to see the choice, then simulate it with the strategy=hybrid overrides it prints."
        )
    layout = strategy.layout_for(devices * nodes, devices, f"trainer.devices={devices} × trainer.num_nodes={nodes}")
    started = time.perf_counter()
    profile, workload, hardware = profile_from_config(cfg, {planned.tp}), workload_from_config(cfg), hardware_from_config(cfg)
    prediction = predict(profile, planned, workload, hardware)
    console.print(f"predicted {planned.describe()} in {time.perf_counter() - started:.1f} s (meta-device dry run of the model)")
    results = []
    for rank in chosen_ranks(layout, ranks):
        console.print(f"simulating rank {rank} of {layout.world_size} ...")
        results.append(run_rank(rank, overrides, config_dir, config_name))
    # FSDP2's later shard ranks hold fewer rows of a tensor that does not divide: each rank is set beside the
    # prediction for its own place in the sharding group (the planner's memory figures are the first's, the fullest).
    by_index = {index: predict(profile, planned, workload, hardware, shard_index=index)
                for index in {shard_index_of(planned, figures["coordinates"]) for figures in results}}
    predictions = [by_index[shard_index_of(planned, figures["coordinates"])] for figures in results]
    if json_path:
        report = [{**figures, "predicted_vs_simulated": compare(figures, own)} for figures, own in zip(results, predictions)]
        text = json.dumps({"prediction": prediction.as_dict(), "ranks": report}, indent=2, default=str)
        if json_path == "-":  # JSON on stdout; the tables went to stderr
            print(text)
        else:
            Path(json_path).write_text(text)
    return 1 if print_simulation(results, predictions, console) else 0
