"""TensorParallelStrategy(plan="auto") against Lightning's ModelParallelStrategy with a hand-written plan.

    python benchmarks/tp_vs_model_parallel.py          # ~6 min on 2 cores; writes benchmarks/results/tp_vs_model_parallel.{md,json}

Both run the recipe GPT (float32, 2 processes × 1 thread, gloo, TP=2). Lightning's strategy needs the
plan written in ``configure_model`` (below: the same Megatron plan, plus the head-count fix our
strategy infers); ours needs nothing in the module. Reported side by side:

- median step time (variants alternate within each round) and the ratio ours / Lightning;
- per-rank bytes of parameters (local shards) — gradients and AdamW's two moments follow the same split;
- communication of one training step, counted by op name at dispatch (``benchmarks.common.collective_count_mode``:
  DTensor's and c10d's collectives, forward and backward), against the Megatron minimum: per block one all-reduce after attention and one
  after the MLP in forward, and the same two in backward (4 × n_layer all-reduces of B×T×d activations);
  with sequence parallelism each becomes an all-gather + reduce-scatter pair.
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
    CommCounter,
    StepTimer,
    median_step,
    run_worker_copies,
    scratch_dir,
)

VARIANTS = ("ours", "lightning", "ours_sp")
MODEL = {"vocab_size": 128, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
#: ``--smoke``: two blocks 32 wide (4 heads: 2 per rank).
SMOKE_MODEL = {**MODEL, "n_layer": 2, "n_embd": 32}
BATCH = 16
SETUP = f"recipe GPT {MODEL['n_layer']}×{MODEL['n_embd']} (0.8M parameters), block {MODEL['block_size']}, batch {BATCH}, float32, TP=2 over 2 processes × 1 thread, gloo"


def worker(variant: str, steps: int, warmup: int, out: Path, smoke: bool = False) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.tensor import DTensor

    from lightning_parallel import TensorParallelStrategy
    from recipes.data.chars import CharCorpusDataModule
    from recipes.models.gpt import GPTLightningModule

    torch.set_num_threads(1)

    class HandWrittenTP(GPTLightningModule):
        """What a user of Lightning's ModelParallelStrategy writes: the plan, by hand, in configure_model."""

        def configure_model(self) -> None:
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            tp_mesh = self.device_mesh["tensor_parallel"]
            for block in self.model.blocks:
                plan = {
                    "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
                    "attn.out_proj": RowwiseParallel(), "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel(),
                }
                parallelize_module(block, tp_mesh, plan)
                block.attn.n_head //= tp_mesh.size()

    config = SMOKE_MODEL if smoke else MODEL
    L.seed_everything(0)
    if variant == "lightning":
        model, strategy = HandWrittenTP(**config), ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    else:
        model, strategy = GPTLightningModule(**config), TensorParallelStrategy(sequence_parallel=variant == "ours_sp")
    counter = CommCounter(step=warmup)

    class Extras(L.Callback):
        def on_train_end(self, trainer, pl_module):
            local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in pl_module.parameters())
            timer.extra.update({"variant": variant, "param_bytes_per_rank": local, "comm_counts": counter.counts})

    timer = StepTimer(out, warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps + warmup, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[counter, Extras(), timer],
    )
    data = CharCorpusDataModule(block_size=config["block_size"], batch_size=BATCH, max_chars=20_000 if smoke else 400_000)
    trainer.fit(model, datamodule=data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a 2×32 GPT, 1 round, 1 timed step (use with --results)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for tp_vs_model_parallel.{md,json}")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.out, args.smoke)
        return
    if args.smoke:
        args.rounds, args.steps, args.warmup = 1, 1, 1
    config, results = SMOKE_MODEL if args.smoke else MODEL, args.results

    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with scratch_dir(results) as scratch:
        for round_index in range(args.rounds):
            for variant in VARIANTS:
                worker_args = ["--worker", variant, "--steps", str(args.steps), "--warmup", str(args.warmup)]
                worker_args += ["--smoke"] if args.smoke else []
                (result,) = run_worker_copies(Path(__file__), worker_args, [scratch / f"{variant}-{time.monotonic_ns()}.json"])
                runs[variant].append(result)
                print(f"round {round_index + 1}/{args.rounds} {variant:9s} median step {median_step(result) * 1e3:7.1f} ms", flush=True)

    medians = {v: [median_step(r) for r in runs[v]] for v in VARIANTS}
    ratios = [o / lt for o, lt in zip(medians["ours"], medians["lightning"], strict=True)]
    n_layer, activation_bytes = config["n_layer"], BATCH * config["block_size"] * config["n_embd"] * 4
    summary = {
        "command": f"python benchmarks/tp_vs_model_parallel.py --rounds {args.rounds} --steps {args.steps}",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "setup": f"smoke: recipe GPT {config}" if args.smoke else SETUP,
        "median_step_s": medians,
        "ratio_ours_over_lightning": {"per_round": ratios, "median": statistics.median(ratios)},
        "param_bytes_per_rank": {v: runs[v][0]["param_bytes_per_rank"] for v in VARIANTS},
        "comm_counts_per_step": {v: runs[v][0]["comm_counts"] for v in VARIANTS},
        "megatron_minimum": {
            "without_sp": {"all_reduce": 4 * n_layer},
            "with_sp": {"all_gather_into_tensor": 4 * n_layer, "reduce_scatter_tensor": 4 * n_layer},
            "bytes_per_collective": activation_bytes,
        },
    }
    (results / "tp_vs_model_parallel.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        "# TensorParallelStrategy(plan=auto) vs Lightning ModelParallelStrategy (hand-written plan)",
        "",
        f"Command: `{summary['command']}` · {summary['machine']}",
        "",
        f"Setup: {summary['setup']}. Each cell is one run's median step time after {args.warmup} warm-up steps; variants alternate.",
        "",
        "| round | Lightning ModelParallel (ms) | ours, plan=auto (ms) | ours + sequence parallel (ms) | ratio ours/Lightning |",
        "|---|---|---|---|---|",
        *[
            f"| {i + 1} | {medians['lightning'][i] * 1e3:.1f} | {medians['ours'][i] * 1e3:.1f} | {medians['ours_sp'][i] * 1e3:.1f} | {ratios[i]:.3f} |"
            for i in range(args.rounds)
        ],
        f"| **median** | | | | **{statistics.median(ratios):.3f}** |",
        "",
        "| variant | parameter bytes per rank | collectives in one training step (by op name, counted at dispatch) |",
        "|---|---|---|",
        *[
            f"| {v} | {summary['param_bytes_per_rank'][v]:,} | "
            + ", ".join(f"{op} × {n}" for op, n in sorted(summary["comm_counts_per_step"][v].items()))
            + " |"
            for v in VARIANTS
        ],
        "",
        f"Megatron minimum per step for {n_layer} blocks: without SP {4 * n_layer} all-reduces; with SP "
        f"{4 * n_layer} all-gathers + {4 * n_layer} reduce-scatters; each moves one B×T×d activation "
        f"({activation_bytes:,} bytes at this batch). Raw figures: tp_vs_model_parallel.json.",
        "",
    ]
    (results / "tp_vs_model_parallel.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
