"""Expert parallelism on a Hugging Face Qwen3-MoE: ours against transformers' own EP and against dense DDP.

    python benchmarks/expert_parallel.py          # ~4 min on 2 cores; writes benchmarks/results/expert_parallel.{md,json}
    python benchmarks/expert_parallel.py --smoke  # a tiny model, 1 round: checks that every variant runs

A Qwen3-MoE from a config scaled to ~27M parameters (94% of them routed experts) is saved locally once (random
weights, nothing downloaded); every variant trains it from that directory for the same steps, 2 processes ×
1 thread, gloo, float32, AdamW, inside a Lightning Trainer, with transformers' ``eager`` experts (the same expert
arithmetic everywhere: the default ``grouped_mm`` has no CPU kernel for every dtype):

- ``ours``: ``from_pretrained(path)`` in ``__init__``, ``HybridParallelStrategy(data_parallel_size=2,
  expert_parallel_size=2)`` (dense parameters replicated, each rank half of every layer's experts);
- ``ours_shard``: the same with ``data_parallel_mode="shard"`` (dense parameters sharded by FSDP2 too);
- ``transformers``: ``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2, ep_size=2,
  ep_implementation="all_to_all"))`` in ``configure_model`` under Lightning's ``ModelParallelStrategy``
  (transformers' EP borrows FSDP's ranks: dense parameters sharded, experts divided);
- ``ddp``: Lightning's ``DDPStrategy``: every rank holds every expert (what a Lightning user has without EP).

Reported side by side: median step time, the ratios against transformers and DDP, and per-rank parameter bytes.
And the collectives of one training step, by op name (``benchmarks.common.CommCounter``: counted at dispatch,
without torch's ``CommDebugMode`` module tracker, which stopped when the experts' call was hooked).
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

VARIANTS = ("ours", "ours_shard", "transformers", "ddp")
CONFIG = {
    "vocab_size": 128, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
    "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 16,
    "num_experts_per_tok": 2, "decoder_sparse_step": 1, "max_position_embeddings": 128, "tie_word_embeddings": False,
}
SMOKE = {**CONFIG, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
         "head_dim": 8, "num_experts": 4}
BLOCK, BATCH = 64, 8


def setup_line(config: dict) -> str:
    return (
        f"Qwen3-MoE {config['num_hidden_layers']}×{config['hidden_size']} ({config['num_experts']} experts of width "
        f"{config['moe_intermediate_size']}, top-{config['num_experts_per_tok']}), block {BLOCK}, batch {BATCH} per rank, "
        "float32, AdamW, eager experts, 2 processes × 1 thread, gloo"
    )


def save_model(path: Path, config: dict) -> tuple[int, int]:
    """Saves the model; (its parameters, of which routed experts)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**config), attn_implementation="sdpa", experts_implementation="eager")
    model.save_pretrained(path)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in model.parameters()), experts


def worker(variant: str, path: Path, steps: int, warmup: int, out: Path) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from lightning_parallel import HybridParallelStrategy
    from recipes.data.chars import CharCorpusDataModule

    torch.set_num_threads(1)
    kwargs = {"attn_implementation": "sdpa", "experts_implementation": "eager"}

    class CausalLM(L.LightningModule):
        def __init__(self, load_in_configure_model: bool) -> None:
            super().__init__()
            self.load_in_configure_model = load_in_configure_model
            self.net = None if load_in_configure_model else AutoModelForCausalLM.from_pretrained(path, **kwargs)

        def configure_model(self) -> None:
            if self.load_in_configure_model and self.net is None:
                from transformers.distributed import DistributedConfig

                config = DistributedConfig(fsdp_size=2, ep_size=2, ep_implementation="all_to_all")
                self.net = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, **kwargs)

        def forward(self, x):
            return self.net(input_ids=x).logits

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Extras(L.Callback):
        def on_train_end(self, trainer, pl_module):
            local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in pl_module.parameters())
            timer.extra.update({"variant": variant, "param_bytes_per_rank": local, "comm_counts": counter.counts})

    L.seed_everything(0)
    if variant == "transformers":
        model, strategy = CausalLM(load_in_configure_model=True), ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    elif variant == "ddp":
        model, strategy = CausalLM(load_in_configure_model=False), DDPStrategy()
    else:
        mode = "shard" if variant == "ours_shard" else "replicate"
        model = CausalLM(load_in_configure_model=False)
        strategy = HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=2, data_parallel_mode=mode)
    timer, counter = StepTimer(out, warmup), CommCounter(step=warmup)
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
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 1 round, 1 timed step (use with --results)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for expert_parallel.{md,json}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset to run")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.model, args.steps, args.warmup, args.out)
        return
    if args.smoke:
        args.rounds, args.steps, args.warmup = 1, 1, 1
    config = SMOKE if args.smoke else CONFIG
    variants = [v for v in args.variants.split(",") if v]
    results = args.results

    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with scratch_dir(results) as scratch:
        model_dir = scratch / "qwen3-moe"
        parameters, experts = save_model(model_dir, config)
        for round_index in range(args.rounds):
            for variant in variants:
                worker_args = ["--worker", variant, "--model", str(model_dir), "--steps", str(args.steps), "--warmup", str(args.warmup)]
                (result,) = run_worker_copies(Path(__file__), worker_args, [scratch / f"{variant}-{time.monotonic_ns()}.json"])
                runs[variant].append(result)
                print(f"round {round_index + 1}/{args.rounds} {variant:12s} median step {median_step(result) * 1e3:8.1f} ms", flush=True)

    medians = {v: [median_step(r) for r in runs[v]] for v in variants}

    def ratios(a: str, b: str) -> dict:
        per_round = [x / y for x, y in zip(medians[a], medians[b], strict=True)]
        return {"per_round": per_round, "median": statistics.median(per_round)}

    whole = parameters * 4
    summary = {
        "command": f"python benchmarks/expert_parallel.py --rounds {args.rounds} --steps {args.steps}",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "setup": setup_line(config),
        "parameters": parameters,
        "expert_parameters": experts,
        "median_step_s": medians,
        "ratio_over_transformers": {v: ratios(v, "transformers") for v in variants if "transformers" in variants},
        "ratio_over_ddp": {v: ratios(v, "ddp") for v in variants if "ddp" in variants},
        "param_bytes_per_rank": {v: runs[v][0]["param_bytes_per_rank"] for v in variants},
        "comm_counts_per_step": {v: runs[v][0]["comm_counts"] for v in variants},
        "whole_model_bytes": whole,
    }
    (results / "expert_parallel.json").write_text(json.dumps(summary, indent=2) + "\n")
    step = lambda v: statistics.median(medians[v]) * 1e3  # noqa: E731
    over = lambda table, v: f"{summary[table][v]['median']:.3f}" if v in summary[table] else "—"  # noqa: E731
    lines = [
        "# Expert parallelism: ours vs transformers' own EP vs dense DDP (Qwen3-MoE)",
        "",
        f"Command: `{summary['command']}` · {summary['machine']}",
        "",
        f"Setup: {summary['setup']} ({parameters:,} parameters, {experts / parameters:.0%} of them routed experts). "
        f"Step times are medians of each run after {args.warmup} warm-up steps, then the median over {args.rounds} "
        "rounds; variants alternate within a round.",
        "",
        "| variant | step (ms) | / transformers EP | / DDP | parameter bytes per rank (of the whole) | collectives in one training step (by op name, counted at dispatch) |",
        "|---|---|---|---|---|---|",
        *[
            f"| {v} | {step(v):.1f} | {over('ratio_over_transformers', v)} | {over('ratio_over_ddp', v)} | "
            f"{summary['param_bytes_per_rank'][v]:,} ({summary['param_bytes_per_rank'][v] / whole:.3f}) | "
            + ", ".join(f"{op} × {n}" for op, n in sorted(summary["comm_counts_per_step"][v].items()))
            + " |"
            for v in variants
        ],
        "",
        "Raw figures: expert_parallel.json.",
        "",
    ]
    (results / "expert_parallel.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
