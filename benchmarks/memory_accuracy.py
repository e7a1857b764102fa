"""Predicted vs measured: the planner's peak memory per rank against what each rank held, setup included.

    python benchmarks/memory_accuracy.py                 # recipe GPT, ~5 min on 2 cores
    python benchmarks/memory_accuracy.py --model llama   # transformers' Llama (model=llama), ~5 min
    python benchmarks/memory_accuracy.py --model qwen2_tied   # transformers' Qwen2, tied embeddings, ~5 min
    python benchmarks/memory_accuracy.py --model llama_lora   # the Llama with peft LoRA adapters, base frozen, ~5 min
    # each writes its model's rows of benchmarks/results/memory_accuracy.{md,json}, keeping the other models'

Each layout trains a model at a size where the training state dominates a process (the recipe GPT 8 blocks × 1024
wide, ~100M parameters; or transformers' ``LlamaForCausalLM`` from ``model=llama``, 6 layers × 1024 wide, GQA,
SwiGLU, RoPE, SDPA attention, ~70M parameters; or a Qwen2 whose tied embeddings a pipeline holds on both
ends; float32, AdamW) for 3 steps through ``recipes/train.py``, built
under ``trainer.init_module(empty_init=True)`` where our strategies run (each rank allocates its part only) and
eagerly for single-device training. The ScalingMonitor measures every rank's peak from before the strategy sets
the model up (:mod:`lightning_parallel.measure.peak_memory`: on a CPU the peak of the bytes glibc's allocator has
handed out, its cache of freed blocks left out, above that figure then, plus what the model already held), and the planner's
prediction for the same layout is its
``peak_memory_bytes`` (the largest pipeline position's parameters, gradients, optimizer state, activations of
the micro-batches in flight, transients, the training runtime, or setup if larger). Reported: the largest rank's
figure of each, and its resident peak beside it (glibc's cache of freed blocks included: what the OS sees). The runs
use the C allocator as a user's run does (no ``MALLOC_*`` tuning).
"""

from __future__ import annotations

import argparse
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
DATA = ["data.batch_size=4", "data.block_size=32"]
MODELS_LLAMA = ["model=llama", "model.config.hidden_size=1024", "model.config.intermediate_size=2816",
                "model.config.num_hidden_layers=6", "model.config.num_attention_heads=8", "model.config.num_key_value_heads=4", *DATA]
#: model -> (what the report calls it, recipe overrides).
MODELS: dict[str, tuple[str, list[str]]] = {
    "gpt": ("recipe GPT 8×1024 (~100M parameters)", ["model.n_layer=8", "model.n_embd=1024", "model.n_head=8", *DATA]),
    "llama": ("transformers LlamaForCausalLM 6×1024, 8 heads / 4 key-value heads, MLP 2816 (~70M parameters)", MODELS_LLAMA),
    # Tied input and output embeddings over a 32k vocabulary (the data's 128 characters use its first rows): one
    # 128 MiB matrix, held by both ends of the model, so by both stages of a pipeline.
    "qwen2_tied": ("transformers Qwen2ForCausalLM 4×1024, tied embeddings over a 32k vocabulary, 8 heads / 4 key-value heads, MLP 2816 (~80M parameters)",
                   ["model=llama", "model.model_type=qwen2", "data.vocab_size=32000", "+model.config.tie_word_embeddings=true",
                    "model.config.hidden_size=1024", "model.config.intermediate_size=2816", "model.config.num_hidden_layers=4",
                    "model.config.num_attention_heads=8", "model.config.num_key_value_heads=4", *DATA]),
    # LoRA fine-tuning (peft): the Llama above, base frozen, rank-16 adapters on every attention and MLP projection
    # (~2.2M trainable of ~70M): no gradients and no optimizer state for the base (the planner counts it so).
    "llama_lora": ("transformers LlamaForCausalLM 6×1024 (the Llama above) with peft LoRA r=16 on q/k/v/o/gate/up/down, base frozen",
                   [*MODELS_LLAMA, "+model.lora={r: 16, lora_alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"]),
}
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
#: model -> the layouts it runs (the Llama's: those that fit the ~15 minutes a busy 2-core machine gives it).
MODEL_LAYOUTS = {"gpt": list(LAYOUTS), "llama": ["single", "dp=2", "dp=2 shard", "tp=2", "pp=2 (1f1b, m=4)", "dp=2 × tp=2"],
                 "qwen2_tied": ["single", "tp=2", "pp=2 (1f1b, m=4)"],
                 "llama_lora": ["single", "dp=2", "dp=2 shard", "tp=2", "pp=2 (1f1b, m=4)"]}


def measure(devices: int, overrides: list[str], model: list[str], run_dir: Path) -> dict[str, Any]:
    """One layout through the recipe; the monitor's measured and predicted peaks (bytes)."""
    init = [] if any(o.startswith("empty_init") for o in overrides) else ["empty_init=true"]
    run_training(
        "recipes/train.py",
        [*overrides, *init, *model, f"trainer.devices={devices}", f"trainer.max_steps={STEPS}",
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
        "resident_bytes": max(scaling["resident_peak_bytes_by_rank"]),
    }


def write_report(results: dict[str, dict[str, Any]]) -> None:
    """The page and the JSON, one section per measured model (``results``: model -> its rows)."""
    lines = [
        "# Peak memory per rank: predicted vs measured",
        "",
        f"`python benchmarks/memory_accuracy.py [--model gpt|llama|qwen2_tied|llama_lora]` — float32, AdamW, 4 sequences of 32 tokens per "
        f"replica, {STEPS} steps; CPU ({platform.machine()}, {os.cpu_count()} cores), gloo, the ScalingMonitor's "
        "per-rank peak from before setup (on a CPU the bytes glibc's allocator has handed out, its cache of freed "
        "blocks left out, sampled every 50 ms), with the C allocator as a user runs it. Resident peak: what the OS sees, that "
        "cache included (not predicted). Goal: predicted / measured within 0.9–1.1 for every layout.",
    ]
    for model, rows in results.items():
        ratios = [r["predicted_bytes"] / r["measured_bytes"] for r in rows.values()]
        lines += [
            "",
            f"## {MODELS[model][0]}",
            "",
            f"Predicted / measured: **{min(ratios):.2f}–{max(ratios):.2f}**.",
            "",
            "| layout | predicted MiB (largest rank) | measured MiB (largest rank) | predicted / measured | measured, every rank | "
            "resident peak MiB (largest rank) |",
            "|---|---|---|---|---|---|",
        ]
        for name, row in rows.items():
            every = ", ".join(f"{b / 2**20:.0f}" for b in row["measured_by_rank"])
            resident = f"{row['resident_bytes'] / 2**20:.0f}" if "resident_bytes" in row else "–"
            lines.append(f"| {name} | {row['predicted_bytes'] / 2**20:.0f} | {row['measured_bytes'] / 2**20:.0f} | "
                         f"{row['predicted_bytes'] / row['measured_bytes']:.2f} | {every} | {resident} |")
    (RESULTS / "memory_accuracy.md").write_text("\n".join(lines) + "\n")
    sections = {model: {"model": MODELS[model][1], "steps": STEPS, "results": rows} for model, rows in results.items()}
    (RESULTS / "memory_accuracy.json").write_text(json.dumps(sections, indent=2))


def earlier_results() -> dict[str, dict[str, Any]]:
    """Rows already on file, by model (the page written before models had sections held the GPT's alone)."""
    path = RESULTS / "memory_accuracy.json"
    if not path.is_file():
        return {}
    found = json.loads(path.read_text())
    if "results" in found:
        return {"gpt": found["results"]}
    return {model: section["results"] for model, section in found.items() if model in MODELS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt", help="the model to measure (default: gpt)")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), help="only these layouts (default: the model's)")
    args = parser.parse_args()
    results = earlier_results()
    # --layouts replaces those rows of the model's and keeps the rest; a whole run replaces them all
    kept = {k: v for k, v in results.get(args.model, {}).items() if k not in (args.layouts or MODEL_LAYOUTS[args.model])} if args.layouts else {}
    rows: dict[str, dict[str, Any]] = {}
    with scratch_dir() as scratch:
        for name in args.layouts or MODEL_LAYOUTS[args.model]:
            devices, overrides = LAYOUTS[name]
            rows[name] = measure(devices, overrides, MODELS[args.model][1], scratch / f"run{len(rows)}")
            row = rows[name]
            print(f"{name}: predicted {row['predicted_bytes'] / 2**20:.0f} MiB, measured {row['measured_bytes'] / 2**20:.0f} MiB "
                  f"({row['predicted_bytes'] / row['measured_bytes']:.2f})", flush=True)
            merged = {**kept, **rows}
            results[args.model] = {k: merged[k] for k in LAYOUTS if k in merged}  # written after each layout: a failure keeps the rows measured
            write_report(results)


if __name__ == "__main__":
    main()
