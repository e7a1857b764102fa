"""Step time of our DataParallelStrategy against Lightning's DDPStrategy, and DP scaling efficiency.

    python benchmarks/dp_vs_ddp.py                  # ~20 min on 2 cores; writes benchmarks/results/dp_vs_ddp.{md,json}
    python benchmarks/dp_vs_ddp.py --rounds 5 --steps 60 --batch-sizes 16

Every run trains the recipe GPT (float32) on CPU with one thread per process, so that "2 ranks" really
means two cores. Within a round the variants alternate (ours, ddp, single, pair) so that drift of the
machine affects all alike; each run reports its median step time after a warm-up. Two per-rank batch
sizes show the seed's point: the larger T_compute is against the fixed T_comm, the better DP scales.

- step-time ratio = median step time under DataParallelStrategy / under DDPStrategy, same 2 processes;
- scaling efficiency = throughput of 2 ranks × 1 thread / (2 × throughput of 1 rank × 1 thread), i.e.
  measured speedup over ideal speedup with the per-rank batch held fixed (weak scaling, as in the seed's
  S = T_compute / (T_compute/k + T_comm) with k = 2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks.*` importable

from benchmarks.common import (
    RESULTS,
    StepTimer,
    median_step,
    run_worker_copies,
    scratch_dir,
)

VARIANTS = ("ours", "ddp", "single", "pair")


#: The recipe GPT's size; ``--smoke``: one block 32 wide.
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128}
SMOKE_MODEL = {"n_layer": 1, "n_head": 2, "n_embd": 32}
SETUP = "recipe GPT 4×128 (0.8M parameters, 3.3 MB of float32 gradients), block 64, float32, 1 thread per process, gloo"


def worker(variant: str, batch_size: int, steps: int, warmup: int, out: Path, smoke: bool = False) -> None:
    """One training run; rank 0 writes its step times to ``out``."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_parallel import DataParallelStrategy
    from recipes.data.chars import CharCorpusDataModule
    from recipes.models.gpt import GPTLightningModule

    torch.set_num_threads(1)

    L.seed_everything(0)
    strategies = {
        "ours": DataParallelStrategy(),
        "ours_untracked": DataParallelStrategy(track_communication=False),
        "ddp": DDPStrategy(),
        "single": "auto",
    }
    timer = StepTimer(out, warmup, {"variant": variant})
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1 if variant == "single" else 2,
        strategy=strategies[variant],
        max_steps=steps + warmup,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[timer],
    )
    model = GPTLightningModule(vocab_size=128, block_size=64, **(SMOKE_MODEL if smoke else MODEL))
    data = CharCorpusDataModule(block_size=64, batch_size=batch_size, max_chars=20_000 if smoke else 400_000)
    trainer.fit(model, datamodule=data)


def run_variant(variant: str, batch_size: int, steps: int, warmup: int, scratch: Path, smoke: bool = False) -> float:
    """Median step time of one run; for ``pair``, the mean of two concurrent single-process runs."""
    copies = 2 if variant == "pair" else 1
    worker_variant = "single" if variant == "pair" else variant
    outs = [scratch / f"{variant}-{i}-{time.monotonic_ns()}.json" for i in range(copies)]
    args = ["--worker", worker_variant, "--batch-size", str(batch_size), "--steps", str(steps), "--warmup", str(warmup)]
    args += ["--smoke"] if smoke else []
    ranks = 1 if worker_variant == "single" else 2
    return statistics.mean(median_step(result) for result in run_worker_copies(Path(__file__), args, outs, ranks=ranks))


def measure(batch_size: int, rounds: int, steps: int, warmup: int, scratch: Path, smoke: bool = False) -> dict:
    """Alternate the variants for ``rounds`` rounds at one per-rank batch size; ratios per round."""
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_index in range(rounds):
        for variant in VARIANTS:
            medians[variant].append(run_variant(variant, batch_size, steps, warmup, scratch, smoke))
            print(f"batch {batch_size} round {round_index + 1}/{rounds} {variant:6s} "
                  f"median step {medians[variant][-1] * 1e3:7.1f} ms", flush=True)
    # Per-rank batch is fixed, so 2 ranks process twice the samples per step: efficiency is a ratio of
    # step times. Against an isolated single run it includes the machine's own contention (two busy
    # cores share caches and memory bandwidth); against two concurrent independent runs ("pair") it
    # isolates what data parallelism adds: gradient communication and waiting for the slower rank.
    per_round = {
        "ratio_ours_over_ddp": [o / d for o, d in zip(medians["ours"], medians["ddp"])],
        "efficiency_ours": [s / o for s, o in zip(medians["single"], medians["ours"])],
        "efficiency_ddp": [s / d for s, d in zip(medians["single"], medians["ddp"])],
        "efficiency_ours_vs_concurrent": [p / o for p, o in zip(medians["pair"], medians["ours"])],
    }
    return {
        "batch_size_per_rank": batch_size,
        "median_step_s": medians,
        "per_round": per_round,
        "median": {name: statistics.median(values) for name, values in per_round.items()},
    }


def format_table(result: dict) -> list[str]:
    medians, per_round, median = result["median_step_s"], result["per_round"], result["median"]
    lines = [
        f"### Per-rank batch {result['batch_size_per_rank']}",
        "",
        "| round | single 1×1 (ms) | 2 concurrent singles (ms) | DDPStrategy 2×1 (ms) | DataParallelStrategy 2×1 (ms) "
        "| ratio ours/DDP | eff. ours vs isolated | eff. DDP vs isolated | eff. ours vs concurrent |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i in range(len(medians["ours"])):
        times = " | ".join(f"{medians[v][i] * 1e3:.1f}" for v in ("single", "pair", "ddp", "ours"))
        ratios = " | ".join(f"{per_round[k][i]:.3f}" for k in per_round)
        lines.append(f"| {i + 1} | {times} | {ratios} |")
    lines.append("| **median** | | | | | " + " | ".join(f"**{median[k]:.3f}**" for k in per_round) + " |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-sizes", default="16,64", help="per-rank batch sizes, comma-separated")
    parser.add_argument("--smoke", action="store_true", help="a 1×32 GPT, batch 4, 1 round, 1 timed step (use with --results)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for dp_vs_ddp.{md,json}")
    parser.add_argument("--worker", choices=(*VARIANTS, "ours_untracked"), help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.batch_size, args.steps, args.warmup, args.out, args.smoke)
        return
    if args.smoke:
        args.rounds, args.steps, args.warmup, args.batch_sizes = 1, 1, 1, "4"
    out = args.results
    with scratch_dir(out) as scratch:
        results = [measure(int(b), args.rounds, args.steps, args.warmup, scratch, args.smoke) for b in args.batch_sizes.split(",")]

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    setup = f"smoke: recipe GPT {SMOKE_MODEL}" if args.smoke else SETUP
    command = f"python benchmarks/dp_vs_ddp.py --rounds {args.rounds} --steps {args.steps} --batch-sizes {args.batch_sizes}"
    (out / "dp_vs_ddp.json").write_text(json.dumps({"command": command, "machine": machine, "setup": setup, "results": results}, indent=2) + "\n")
    lines = [
        "# DataParallelStrategy vs Lightning DDPStrategy (CPU, 2 processes × 1 thread)",
        "",
        f"Command: `{command}` · {machine}",
        "",
        f"Setup: {setup}. Each cell is one run's median step time after {args.warmup} warm-up steps;",
        "the variants alternate within each round.",
        "",
        *[line for result in results for line in format_table(result)],
        "Targets: ratio ≤ 1.02; scaling efficiency ≥ 0.9. Efficiency = throughput of 2 ranks × 1 thread over",
        "2 × throughput of 1 rank × 1 thread (same per-rank batch, so a ratio of step times), against an isolated",
        "single-process run and against two independent single-process runs sharing the machine (what is left",
        "is the cost of data parallelism itself: the gradient all-reduce and waiting for the slower rank).",
        "",
    ]
    (out / "dp_vs_ddp.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
