"""Step time of our DataParallelStrategy against Lightning's DDPStrategy, and DP scaling efficiency.

    python benchmarks/dp_vs_ddp.py                  # ~5 min on 2 cores; writes benchmarks/results/dp_vs_ddp.{md,json}
    python benchmarks/dp_vs_ddp.py --rounds 5 --steps 60

Every run trains the recipe GPT (float32) on CPU with one thread per process, so that "2 ranks" really
means two cores. Runs alternate (ours, ddp, single, ours, ddp, single, ...) so that drift of the machine
affects all variants alike; each run reports the median step time after a warm-up.

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
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
VARIANTS = ("ours", "ddp", "single")


def worker(variant: str, steps: int, warmup: int, out: Path) -> None:
    """One training run; rank 0 writes its step times to ``out``."""
    sys.path.insert(0, str(REPO_ROOT))
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_parallel import DataParallelStrategy
    from recipes.data.chars import CharCorpusDataModule
    from recipes.models.gpt import GPTLightningModule

    torch.set_num_threads(1)

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            if batch_idx == 0:
                self.last = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

        def on_train_end(self, trainer, pl_module):  # noqa: ANN001
            if trainer.is_global_zero:
                out.write_text(json.dumps({"variant": variant, "step_times": self.times[warmup:], "world_size": trainer.world_size}))

    L.seed_everything(0)
    strategies = {"ours": DataParallelStrategy(), "ddp": DDPStrategy(), "single": "auto"}
    timer = StepTimer()
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
    model = GPTLightningModule(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=128)
    data = CharCorpusDataModule(block_size=64, batch_size=16, max_chars=400_000)
    trainer.fit(model, datamodule=data)


def run_variant(variant: str, steps: int, warmup: int, scratch: Path) -> dict:
    out = scratch / f"{variant}-{time.monotonic_ns()}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # one core per process; Lightning keeps a value that is already set
    command = [sys.executable, __file__, "--worker", variant, "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
    subprocess.run(command, cwd=REPO_ROOT, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.out)
        return

    scratch = RESULTS / ".scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    medians: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_index in range(args.rounds):
        for variant in VARIANTS:
            result = run_variant(variant, args.steps, args.warmup, scratch)
            medians[variant].append(statistics.median(result["step_times"]))
            print(f"round {round_index + 1}/{args.rounds} {variant:6s} median step {medians[variant][-1] * 1e3:7.1f} ms", flush=True)
    for leftover in scratch.iterdir():
        leftover.unlink()
    scratch.rmdir()

    ratios = [ours / ddp for ours, ddp in zip(medians["ours"], medians["ddp"])]
    # Per-rank batch is fixed, so 2 ranks process twice the samples per step.
    efficiencies = [single / two_rank for single, two_rank in zip(medians["single"], medians["ours"])]
    ddp_efficiencies = [single / two_rank for single, two_rank in zip(medians["single"], medians["ddp"])]
    summary = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "setup": "recipe GPT 4x128 (0.8M params), block 64, batch 16/rank, float32, 1 thread per process, gloo",
        "rounds": args.rounds,
        "timed_steps_per_run": args.steps,
        "median_step_s": {v: medians[v] for v in VARIANTS},
        "step_time_ratio_ours_over_ddp": {"per_round": ratios, "median": statistics.median(ratios)},
        "scaling_efficiency_ours": {"per_round": efficiencies, "median": statistics.median(efficiencies)},
        "scaling_efficiency_ddp": {"per_round": ddp_efficiencies, "median": statistics.median(ddp_efficiencies)},
    }
    (RESULTS / "dp_vs_ddp.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = [
        "# DataParallelStrategy vs Lightning DDPStrategy (CPU, 2 processes × 1 thread)",
        "",
        f"Command: `python benchmarks/dp_vs_ddp.py --rounds {args.rounds} --steps {args.steps}` · {summary['machine']}",
        f"Setup: {summary['setup']}. Median step time per run, runs alternated.",
        "",
        "| round | single 1×1 (ms) | DDPStrategy 2×1 (ms) | DataParallelStrategy 2×1 (ms) | ratio ours/DDP | scaling eff. ours | scaling eff. DDP |",
        "|---|---|---|---|---|---|---|",
    ]
    for i in range(args.rounds):
        table.append(
            f"| {i + 1} | {medians['single'][i] * 1e3:.1f} | {medians['ddp'][i] * 1e3:.1f} | {medians['ours'][i] * 1e3:.1f} "
            f"| {ratios[i]:.3f} | {efficiencies[i]:.3f} | {ddp_efficiencies[i]:.3f} |"
        )
    table += [
        f"| **median** | | | | **{statistics.median(ratios):.3f}** | **{statistics.median(efficiencies):.3f}** "
        f"| **{statistics.median(ddp_efficiencies):.3f}** |",
        "",
        "Targets: ratio ≤ 1.02; scaling efficiency ≥ 0.9 "
        "(throughput of 2 ranks × 1 thread over 2 × throughput of 1 rank × 1 thread, same per-rank batch).",
        "",
    ]
    (RESULTS / "dp_vs_ddp.md").write_text("\n".join(table))
    print("\n".join(table))


if __name__ == "__main__":
    main()
