"""Memory and step time of every layout on a ~50M-parameter GPT, side by side with Lightning's own strategies.

    python benchmarks/hybrid_layouts.py      # ~15 min on 2 cores; writes benchmarks/results/hybrid_layouts.{md,json}

The recipe GPT scaled up (8 blocks × 704 wide, 48M parameters, float32, AdamW) trains with the same
global batch under: Lightning's single device; our HybridParallelStrategy as dp=2 (replicate and shard),
tp=2, pp=2, every pair on 4 ranks, dp=2 × tp=2 × pp=2 on 8 ranks; and, in the same run, Lightning's
DDPStrategy on 2 ranks (Lightning's FSDPStrategy refuses CPU, and its ModelParallelStrategy needs a
hand-written ``configure_model``). Reported per layout:

- per-rank training state (parameters + gradients + AdamW state, counted from each rank's local shards
  with ``lightning_parallel.measure.memory.state_bytes``; the largest rank), as a fraction of single device;
- peak resident memory growth of the largest rank during ``fit`` (includes activations, communication
  buffers and, before the model is cut, the whole model built on every rank);
- median step time relative to single device. Every process gets one thread, so 2-rank layouts use both
  cores and 4/8-rank layouts oversubscribe them: on this machine step time says how much communication and
  scheduling each layout adds, not how it scales on real devices.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
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

MODEL = {"vocab_size": 128, "block_size": 32, "n_layer": 8, "n_head": 8, "n_embd": 704}
#: ``--smoke``: two blocks 32 wide, and only layouts of at most 2 processes (the 4- and 8-rank ones are the test
#: suite's shared launches, tests/distributed/test_hybrid_parallel.py).
SMOKE_MODEL = {**MODEL, "n_layer": 2, "n_head": 2, "n_embd": 32}
SMOKE_LAYOUTS = ("single (Lightning)", "dp=2 DDPStrategy (Lightning)", "dp=2 shard + act. ckpt", "tp=2", "pp=2 (1f1b, m=4)")
GLOBAL_BATCH = 8
#: name -> (processes, HybridParallelStrategy arguments, or a Lightning strategy name)
LAYOUTS: dict[str, tuple[int, dict | str]] = {
    "single (Lightning)": (1, "auto"),
    "dp=2 DDPStrategy (Lightning)": (2, "ddp"),
    "dp=2 replicate": (2, {"data_parallel_size": 2}),
    "dp=2 shard": (2, {"data_parallel_size": 2, "data_parallel_mode": "shard"}),
    "dp=2 shard + act. ckpt": (2, {"data_parallel_size": 2, "data_parallel_mode": "shard", "activation_checkpointing": "auto"}),
    "tp=2": (2, {"data_parallel_size": 1, "tensor_parallel_size": 2}),
    "pp=2 (1f1b, m=4)": (2, {"data_parallel_size": 1, "pipeline_parallel_size": 2, "microbatches": 4}),
    "dp=2 × tp=2": (4, {"data_parallel_size": 2, "tensor_parallel_size": 2}),
    "dp=2 × tp=2 shard": (4, {"data_parallel_size": 2, "tensor_parallel_size": 2, "data_parallel_mode": "shard"}),
    "dp=2 × pp=2": (4, {"data_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 2}),
    "tp=2 × pp=2": (4, {"data_parallel_size": 1, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 4}),
    "dp=2 × tp=2 × pp=2": (8, {"data_parallel_size": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 2}),
}


def _rss_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def worker(name: str, steps: int, warmup: int, out: Path, smoke: bool = False) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_parallel import HybridParallelStrategy
    from lightning_parallel.measure.memory import state_bytes
    from lightning_parallel.strategies.optimizer import unwrap_optimizer
    from recipes.data.chars import CharCorpusDataModule
    from recipes.models.gpt import GPTLightningModule

    torch.set_num_threads(1)
    L.seed_everything(0)
    devices, spec = LAYOUTS[name]
    strategy = spec if isinstance(spec, str) else HybridParallelStrategy(**spec)
    dp = spec.get("data_parallel_size", 1) if isinstance(spec, dict) else devices
    rss_at_start = _rss_kib()

    class Memory(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.state = state_bytes(pl_module, [unwrap_optimizer(o) for o in trainer.optimizers]).as_dict()

        def on_train_end(self, trainer, pl_module):
            mine = {**self.state, "peak_rss_growth": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_at_start) * 1024}
            per_rank = [mine]
            if dist.is_initialized():
                per_rank = [None] * dist.get_world_size()
                dist.all_gather_object(per_rank, mine)
            timer.extra.update({"layout": name, "per_rank": per_rank})

    timer = StepTimer(out, warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps + warmup, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[Memory(), timer],
    )
    data = CharCorpusDataModule(block_size=MODEL["block_size"], batch_size=GLOBAL_BATCH // dp, max_chars=20_000 if smoke else 400_000)
    trainer.fit(GPTLightningModule(**(SMOKE_MODEL if smoke else MODEL)), datamodule=data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a 2×32 GPT, layouts of ≤ 2 processes, 1 timed step (use with --results)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for hybrid_layouts.{md,json}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.out, args.smoke)
        return
    if args.smoke:
        args.steps, args.warmup = 1, 1
    results, model = args.results, SMOKE_MODEL if args.smoke else MODEL

    rows = []
    with scratch_dir(results) as scratch:
        for name in SMOKE_LAYOUTS if args.smoke else LAYOUTS:
            worker_args = ["--worker", name, "--steps", str(args.steps), "--warmup", str(args.warmup)]
            worker_args += ["--smoke"] if args.smoke else []
            outs = [scratch / f"{time.monotonic_ns()}.json"]
            (result,) = run_worker_copies(Path(__file__), worker_args, outs, ranks=LAYOUTS[name][0])
            per_rank = result["per_rank"]
            row = {
                "layout": name,
                "processes": result["world_size"],
                "step_s": median_step(result),
                "state_bytes_max_rank": max(r["total"] for r in per_rank),
                "peak_rss_growth_max_rank": max(r["peak_rss_growth"] for r in per_rank),
                "per_rank": per_rank,
            }
            rows.append(row)
            print(f"{name:32s} step {row['step_s']:.2f} s, state {row['state_bytes_max_rank'] / 2**20:.0f} MiB/rank", flush=True)
    single = rows[0]
    for row in rows:
        row["state_fraction"] = row["state_bytes_max_rank"] / single["state_bytes_max_rank"]
        row["step_time_ratio"] = row["step_s"] / single["step_s"]
    params = single["per_rank"][0]["parameters"] // 4
    summary = {
        "command": f"python benchmarks/hybrid_layouts.py --steps {args.steps} --warmup {args.warmup}",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "model": {**model, "parameters": params},
        "global_batch": GLOBAL_BATCH,
        "runs": rows,
    }
    (results / "hybrid_layouts.json").write_text(json.dumps(summary, indent=2) + "\n")
    mib = 2**20
    lines = [
        "# Layouts side by side: per-rank memory and step time (recipe GPT, 48M parameters)",
        "",
        f"Command: `{summary['command']}` · {summary['machine']}",
        "",
        f"Recipe GPT {model['n_layer']} blocks × {model['n_embd']} ({params / 1e6:.1f}M parameters, tied embedding), "
        f"float32, AdamW, global batch {GLOBAL_BATCH} × {model['block_size']} tokens; one thread per process "
        f"(2 cores: 4- and 8-rank layouts oversubscribe them). State = parameters + gradients + AdamW moments held "
        f"by the largest rank (local shards). Peak RSS growth = largest rank's peak resident memory during fit minus "
        f"before (activations, buffers, and the whole model each rank builds before it is cut). Median of "
        f"{args.steps} steps after {args.warmup} warm-up steps.",
        "",
        "| layout | processes | state per rank (MiB) | state / single | params / grads / optimizer (MiB) | peak RSS growth (MiB) | step (s) | step / single |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        big = max(r["per_rank"], key=lambda x: x["total"])
        lines.append(
            f"| {r['layout']} | {r['processes']} | {r['state_bytes_max_rank'] / mib:.0f} | {r['state_fraction']:.2f} | "
            f"{big['parameters'] / mib:.0f} / {big['gradients'] / mib:.0f} / {big['optimizer'] / mib:.0f} | "
            f"{r['peak_rss_growth_max_rank'] / mib:.0f} | {r['step_s']:.2f} | {r['step_time_ratio']:.2f} |"
        )
    lines += ["", READING, ""]
    (results / "hybrid_layouts.md").write_text("\n".join(lines))
    print("\n".join(lines))


READING = (
    "Reading the numbers: state per rank follows each layout's arithmetic — tp=2 halves the split layers "
    "(the small embeddings, norms and row-wise biases stay whole), pp=2 halves the blocks (the tied embedding "
    "lives on both stages), shard divides everything by dp, and they multiply (0.25 for dp=2 × tp=2 shard and "
    "for tp=2 × pp=2). Peak RSS falls less than the state: every rank first builds the whole model before it "
    "is split (built eagerly here; setup_memory.md measures building on the meta device), and FSDP2 keeps gathered parameters and communication "
    "buffers. Activation checkpointing does not show here: at 4 × 32 tokens per rank the activations are a few "
    "MiB against 730 MiB of state (tests/unit/test_activation_checkpointing.py measures the saved bytes "
    "directly: < 35% of the plain model's). Step times on 2 CPU cores show overheads, not scaling: gloo moves "
    "every collective through memory copies (a 190 MB gradient all-reduce per step makes dp=2 no faster "
    "than one process: the seed's scaling wall), sharding adds an all-gather per block in forward and "
    "backward, tensor-parallel pipeline stages pay DTensor's per-op dispatch, and 4- and 8-rank layouts "
    "share two cores. Our dp=2 replicate and Lightning's DDPStrategy differ within this machine's noise (±10%)."
)


if __name__ == "__main__":
    main()
