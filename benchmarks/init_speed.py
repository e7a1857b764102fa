"""Setup time of a meta-built model's starting values: eager-equal (``init_values: eager``) against drawn into the
rank's shards (``init_values: draw_into_shards``), and building it eagerly on the host, for a Llama-style model
(transformers' ``LlamaForCausalLM``, random weights) as large as this machine holds comfortably.

One process, the whole model as its part (world 1): the figure per parameter is what a rank pays per parameter of
its part, so a rank of a sharded layout pays it for its share. Run: ``python benchmarks/init_speed.py``; writes
``benchmarks/results/init_speed.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from lightning_parallel.parallelize.placement.deferred_init import InitialValues, allocate_local, parameters_on_meta

RESULTS = Path(__file__).resolve().parent / "results"


def llama(hidden: int, layers: int, intermediate: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate, vocab_size=vocab,
                         num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512))
    return LlamaForCausalLM(config)


def measure(hidden: int, layers: int, intermediate: int, vocab: int) -> dict[str, float]:
    shape = (hidden, layers, intermediate, vocab)
    torch.manual_seed(0)
    start = time.perf_counter()
    eager = llama(*shape)
    eager_s = time.perf_counter() - start
    params = sum(p.numel() for p in eager.parameters())
    del eager
    figures: dict[str, float] = {"parameters": params, "eager_construction_s": eager_s}
    for mode in ("eager", "draw_into_shards"):
        with parameters_on_meta():
            model = llama(*shape)
        values = InitialValues.of(model)
        allocate_local(model, torch.device("cpu"))
        targets = dict(model.named_parameters(remove_duplicate=False))
        start = time.perf_counter()
        if mode == "eager":
            values.write(targets)
        else:
            values.draw_into_shards(targets, seed=0)
        figures[f"{mode}_s"] = time.perf_counter() - start
        del model, values, targets
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    figures = measure(args.hidden, args.layers, args.intermediate, args.vocab)
    billion = figures["parameters"] / 1e9
    per_b = {key: figures[f"{key}_s"] / billion for key in ("eager_construction", "eager", "draw_into_shards")}
    result = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
              "model": vars(args) | {"out": None}, **figures, "seconds_per_billion": per_b}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "init_speed.json").write_text(json.dumps(result, indent=2, default=str))
    lines = [
        "# Starting values of a meta-built model: setup time (one process, CPU)",
        "",
        f"`python benchmarks/init_speed.py` — Llama-style, {billion:.3f} B parameters, float32; {result['machine']}.",
        "",
        "| how | seconds | seconds per billion parameters |",
        "|---|---|---|",
        f"| eager construction on the host (`LlamaForCausalLM(config)`) | {figures['eager_construction_s']:.1f} | {per_b['eager_construction']:.1f} |",
        f"| meta, `init_values: eager` (each module whole on the host, twice) | {figures['eager_s']:.1f} | {per_b['eager']:.1f} |",
        f"| meta, `init_values: draw_into_shards` (drawn into the part) | {figures['draw_into_shards_s']:.1f} | {per_b['draw_into_shards']:.1f} |",
    ]
    (args.out / "init_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
