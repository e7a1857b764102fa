"""TensorParallelStrategy(plan="auto") on a Hugging Face Llama against transformers' own tensor parallelism.

    python benchmarks/tp_vs_hf_tp.py          # ~10 min on 2 cores; writes benchmarks/results/tp_vs_hf_tp.{md,json}
    python benchmarks/tp_vs_hf_tp.py --smoke --results /tmp/smoke   # a 2-layer Llama, 1 round, 1 step: seconds

A Llama (GQA) from a config scaled to ~50M parameters is saved locally once (random weights, nothing
downloaded); both variants train it from that directory for the same steps, 2 processes × 1 thread, gloo,
TP=2, float32, inside a Lightning Trainer:

- ``ours``: ``from_pretrained(path)`` in ``__init__``, ``TensorParallelStrategy()`` (plan inferred);
- ``transformers``: ``from_pretrained(path, tp_plan="auto", device_mesh=...)`` in ``configure_model`` under
  Lightning's ``ModelParallelStrategy`` (how a Lightning user would use transformers' TP).

Reported side by side: median step time and the ratio ours / transformers, per-rank parameter bytes (local
shards), and the collectives of one training step (by op name at dispatch, ``benchmarks.common.collective_count_mode``: DTensor's and c10d's collectives).
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

VARIANTS = ("ours", "transformers")
CONFIG = {
    "vocab_size": 128, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 16,
    "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 128, "tie_word_embeddings": False,
}
#: ``--smoke``: the same architecture, tiny.
SMOKE = {**CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
BLOCK, BATCH = 64, 8
SETUP = (
    f"Llama {CONFIG['num_hidden_layers']}×{CONFIG['hidden_size']} (GQA {CONFIG['num_attention_heads']}/{CONFIG['num_key_value_heads']} heads, "
    f"~50M parameters), block {BLOCK}, batch {BATCH}, float32, AdamW, TP=2 over 2 processes × 1 thread, gloo"
)


def save_model(path: Path, config: dict = CONFIG) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**config)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def worker(variant: str, path: Path, steps: int, warmup: int, out: Path) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from lightning_parallel import TensorParallelStrategy
    from recipes.data.chars import CharCorpusDataModule

    torch.set_num_threads(1)

    class CausalLM(L.LightningModule):
        def __init__(self, load_in_configure_model: bool) -> None:
            super().__init__()
            self.load_in_configure_model = load_in_configure_model
            self.net = None if load_in_configure_model else AutoModelForCausalLM.from_pretrained(path)

        def configure_model(self) -> None:
            if self.load_in_configure_model and self.net is None:
                self.net = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", device_mesh=self.device_mesh["tensor_parallel"])

        def forward(self, x):
            return self.net(input_ids=x).logits

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x).reshape(-1, CONFIG["vocab_size"]), y.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Extras(L.Callback):
        def on_train_end(self, trainer, pl_module):
            local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in pl_module.parameters())
            timer.extra.update({"variant": variant, "param_bytes_per_rank": local, "comm_counts": counter.counts})

    L.seed_everything(0)
    if variant == "ours":
        model, strategy = CausalLM(load_in_configure_model=False), TensorParallelStrategy(tensor_parallel_size=2)
    else:
        model, strategy = CausalLM(load_in_configure_model=True), ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    counter = CommCounter(step=warmup)
    timer = StepTimer(out, warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps + warmup, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[counter, Extras(), timer],
    )
    trainer.fit(model, datamodule=CharCorpusDataModule(block_size=BLOCK, batch_size=BATCH, max_chars=200_000))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama, 1 round, 1 timed step (use with --results)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for tp_vs_hf_tp.{md,json}")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.model, args.steps, args.warmup, args.out)
        return
    if args.smoke:
        args.rounds, args.steps, args.warmup = 1, 1, 1
    results = args.results
    results.mkdir(parents=True, exist_ok=True)

    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with scratch_dir(results) as scratch:
        model_dir = scratch / "llama"
        parameters = save_model(model_dir, SMOKE if args.smoke else CONFIG)
        for round_index in range(args.rounds):
            for variant in VARIANTS:
                worker_args = ["--worker", variant, "--model", str(model_dir), "--steps", str(args.steps), "--warmup", str(args.warmup)]
                (result,) = run_worker_copies(Path(__file__), worker_args, [scratch / f"{variant}-{time.monotonic_ns()}.json"])
                runs[variant].append(result)
                print(f"round {round_index + 1}/{args.rounds} {variant:12s} median step {median_step(result) * 1e3:8.1f} ms", flush=True)

    medians = {v: [median_step(r) for r in runs[v]] for v in VARIANTS}
    ratios = [o / t for o, t in zip(medians["ours"], medians["transformers"], strict=True)]
    summary = {
        "command": f"python benchmarks/tp_vs_hf_tp.py --rounds {args.rounds} --steps {args.steps}",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "setup": SETUP if not args.smoke else f"smoke: {SMOKE}",
        "parameters": parameters,
        "median_step_s": medians,
        "ratio_ours_over_transformers": {"per_round": ratios, "median": statistics.median(ratios)},
        "param_bytes_per_rank": {v: runs[v][0]["param_bytes_per_rank"] for v in VARIANTS},
        "whole_model_bytes": parameters * 4,
        "comm_counts_per_step": {v: runs[v][0]["comm_counts"] for v in VARIANTS},
    }
    (results / "tp_vs_hf_tp.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        "# TensorParallelStrategy(plan=auto) vs transformers' own tensor parallelism (tp_plan=\"auto\")",
        "",
        f"Command: `{summary['command']}` · {summary['machine']}",
        "",
        f"Setup: {summary['setup']} ({parameters:,} parameters). Each cell is one run's median step time after "
        f"{args.warmup} warm-up steps; variants alternate.",
        "",
        "| round | transformers tp_plan=auto (ms) | ours, plan=auto (ms) | ratio ours/transformers |",
        "|---|---|---|---|",
        *[
            f"| {i + 1} | {medians['transformers'][i] * 1e3:.1f} | {medians['ours'][i] * 1e3:.1f} | {ratios[i]:.3f} |"
            for i in range(args.rounds)
        ],
        f"| **median** | | | **{statistics.median(ratios):.3f}** |",
        "",
        "| variant | parameter bytes per rank (of the whole model) | collectives in one training step (by op name, counted at dispatch) |",
        "|---|---|---|",
        *[
            f"| {v} | {summary['param_bytes_per_rank'][v]:,} ({summary['param_bytes_per_rank'][v] / (parameters * 4):.3f}) | "
            + ", ".join(f"{op} × {n}" for op, n in sorted(summary["comm_counts_per_step"][v].items()))
            + " |"
            for v in VARIANTS
        ],
        "",
        "Raw figures: tp_vs_hf_tp.json.",
        "",
    ]
    (results / "tp_vs_hf_tp.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
