"""Predicted vs measured: the planner's peak memory per rank against what each rank held, setup included.

    python benchmarks/memory_accuracy.py     # ~5 min on 2 cores; writes benchmarks/results/memory_accuracy.{md,json}

Each layout trains the recipe GPT at a size where the training state dominates a process (8 blocks × 1024 wide,
~100M parameters, float32, AdamW: ~1.6 GB of state on one device) for 3 steps through ``recipes/train.py``, built
under ``trainer.init_module(empty_init=True)`` where our strategies run (each rank allocates its part only) and
eagerly for single-device training. The ScalingMonitor measures every rank's peak from before the strategy sets
the model up (:mod:`lightning_parallel.measure.peak_memory`: on a CPU the resident peak above the resident
memory then, plus what the model already held), and the planner's prediction for the same layout is its
``peak_memory_bytes`` (the largest pipeline position's parameters, gradients, optimizer state, activations of
the micro-batches in flight, transients, or setup if larger). Reported: the largest rank's figure of each.

glibc keeps freed heap blocks resident, so the resident peak of a CPU process also counts memory no tensor holds;
the runs set ``MALLOC_MMAP_THRESHOLD_=65536`` (blocks of 64 KiB and more are mapped on their own and returned when
freed), so that resident memory follows what tensors hold, as a GPU allocator's peak does. Without it the same runs
read 0.56–0.91 (see the results page).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks.*` importable

from benchmarks.common import REPO_ROOT, RESULTS, scratch_dir
from lightning_parallel.plan.measure import read_scaling, run_training

STEPS = 3
MODEL = ["model.n_layer=8", "model.n_embd=1024", "model.n_head=8", "data.batch_size=4", "data.block_size=32"]
#: name -> (processes, overrides).
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, ["strategy=single", "empty_init=false"]),
    "dp=2": (2, ["strategy=data"]),
    "dp=2 shard": (2, ["strategy=data", "strategy.data_parallel_mode=shard"]),
    "tp=2": (2, ["strategy=tensor"]),
    "pp=2 (1f1b, m=4)": (2, ["strategy=pipeline", "strategy.microbatches=4"]),
    "dp=2 × tp=2": (4, ["strategy=hybrid", "strategy.tensor_parallel_size=2"]),
    "tp=2 × pp=2": (4, ["strategy=hybrid", "strategy.data_parallel_size=1", "strategy.tensor_parallel_size=2",
                        "strategy.pipeline_parallel_size=2", "strategy.microbatches=4"]),
}


def measure(devices: int, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """One layout through the recipe; the monitor's measured and predicted peaks (bytes)."""
    init = [] if any(o.startswith("empty_init") for o in overrides) else ["empty_init=true"]
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the recipe's processes (see the module's docstring)
    run_training(
        "recipes/train.py",
        [*overrides, *init, *MODEL, f"trainer.devices={devices}", f"trainer.max_steps={STEPS}",
         "trainer.limit_val_batches=0", "checkpoint.every_n_train_steps=100000"],
        run_dir,
        cwd=REPO_ROOT,
    )
    scaling = read_scaling(run_dir)
    predicted = scaling["predicted"]
    return {
        "predicted_bytes": predicted["peak_memory_bytes"],
        "predicted_by_pipeline_rank": predicted["memory_by_pipeline_rank"],
        "measured_bytes": max(scaling["peak_memory_bytes_by_rank"]),
        "measured_by_rank": scaling["peak_memory_bytes_by_rank"],
    }


def write_report(rows: dict[str, dict[str, Any]]) -> None:
    ratios = [r["predicted_bytes"] / r["measured_bytes"] for r in rows.values()]
    lines = [
        "# Peak memory per rank: predicted vs measured",
        "",
        f"`python benchmarks/memory_accuracy.py` — recipe GPT 8×1024 (~100M parameters, float32, AdamW), 4 sequences of "
        f"32 tokens per replica, {STEPS} steps; CPU ({platform.machine()}, {os.cpu_count()} cores), gloo, the "
        "ScalingMonitor's per-rank peak from before setup (resident memory on a CPU: an upper bound that includes the "
        "runtime's own growth). Goal: predicted / measured within 0.9–1.1 for every layout.",
        "",
        f"Predicted / measured: **{min(ratios):.2f}–{max(ratios):.2f}**.",
        "",
        "| layout | predicted MiB (largest rank) | measured MiB (largest rank) | predicted / measured | measured, every rank |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        every = ", ".join(f"{b / 2**20:.0f}" for b in row["measured_by_rank"])
        lines.append(f"| {name} | {row['predicted_bytes'] / 2**20:.0f} | {row['measured_bytes'] / 2**20:.0f} | "
                     f"{row['predicted_bytes'] / row['measured_bytes']:.2f} | {every} |")
    (RESULTS / "memory_accuracy.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "memory_accuracy.json").write_text(json.dumps({"model": MODEL, "steps": STEPS, "results": rows}, indent=2))


def main() -> None:
    rows: dict[str, dict[str, Any]] = {}
    with scratch_dir() as scratch:
        for name, (devices, overrides) in LAYOUTS.items():
            rows[name] = measure(devices, overrides, scratch / f"run{len(rows)}")
            row = rows[name]
            print(f"{name}: predicted {row['predicted_bytes'] / 2**20:.0f} MiB, measured {row['measured_bytes'] / 2**20:.0f} MiB "
                  f"({row['predicted_bytes'] / row['measured_bytes']:.2f})", flush=True)
    write_report(rows)


if __name__ == "__main__":
    main()
