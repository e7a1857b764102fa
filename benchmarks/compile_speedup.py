"""Step time with ``compile: true`` against eager, for single, dp2, tp2, pp2 and dp2 with activation
checkpointing, side by side in one run.

    python benchmarks/compile_speedup.py        # ~12 min on 2 cores; writes benchmarks/results/compile_speedup.{md,json}
    python benchmarks/compile_speedup.py --layouts dp2+checkpointing --rounds 1 --results /tmp/cs   # one row, elsewhere

The recipe GPT (float32, 1 thread per process, gloo) under our strategies, each layout eager and with
each block compiled by inductor; the variants of a layout alternate within each round. Reported: the
median step time after warm-up, the ratio compiled / eager, the compile time (the warm-up steps' extra
time over eager's), and dynamo's graphs and graph breaks in the compiled run (a block dynamo gives up on
runs eager). Goal on this CPU: compiled ≤ 0.85 × eager for single and dp2. The ``dp2+checkpointing`` row
has ``activation_checkpointing: auto`` in both of its runs: the compiled blocks are then checkpointed ones
(one graph each, recomputed by the compiler's backward), the eager ones torch's checkpoint.
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

#: layout -> processes; ``+checkpointing``: the same layout with ``activation_checkpointing="auto"`` in both runs.
LAYOUTS = {"single": 1, "dp2": 2, "tp2": 2, "pp2": 2, "dp2+checkpointing": 2}
MODEL = {"vocab_size": 128, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256, "dropout": 0.0}
BATCH = 8  # per data-parallel replica
SETUP = f"recipe GPT {MODEL['n_layer']}×{MODEL['n_embd']}, block {MODEL['block_size']}, batch {BATCH} per replica, float32, 1 thread per process, gloo"


def worker(layout: str, compiled: bool, steps: int, warmup: int, out: Path) -> None:
    import lightning as L
    import torch

    import lightning_parallel as lp
    from recipes.data.chars import CharCorpusDataModule
    from recipes.models.gpt import GPTLightningModule

    torch.set_num_threads(1)
    base, _, extra = layout.partition("+")
    options = {"compile": compiled, **({"activation_checkpointing": "auto"} if extra == "checkpointing" else {})}
    strategy = {
        "single": lambda: lp.DataParallelStrategy(**options),
        "dp2": lambda: lp.DataParallelStrategy(**options),
        "tp2": lambda: lp.TensorParallelStrategy(data_parallel_mode="replicate", **options),
        "pp2": lambda: lp.PipelineParallelStrategy(microbatches=4, **options),
    }[base]()
    started = time.perf_counter()
    timer = StepTimer(out, warmup, extra={"layout": layout, "compiled": compiled})
    trainer = L.Trainer(
        accelerator="cpu", devices=LAYOUTS[layout], strategy=strategy, precision="32-true", max_steps=warmup + steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )
    L.seed_everything(0)
    module = GPTLightningModule(**MODEL, lr=1e-4)
    batch = BATCH * (2 if base == "pp2" else 1)  # pp2: one replica trains the batch two dp ranks would
    data = CharCorpusDataModule(block_size=MODEL["block_size"], batch_size=batch, max_chars=200_000, shuffle=False)
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        result = json.loads(out.read_text())
        result["warmup_s"] = sum(timer.times[:warmup])
        result["wall_s"] = time.perf_counter() - started
        # What dynamo made of the blocks (this rank): a block it gave up on runs eager, at eager's speed.
        from torch._dynamo.utils import counters

        result["graphs"] = counters["stats"]["unique_graphs"]
        result["graph_breaks"] = sum(counters["graph_break"].values())
        out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS), help="rows to run")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for compile_speedup.{md,json}")
    parser.add_argument("--worker", nargs=2, metavar=("LAYOUT", "COMPILED"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1] == "1", args.steps, args.warmup, args.out)
        return
    runs: dict[str, dict[str, list[dict]]] = {layout: {"eager": [], "compiled": []} for layout in args.layouts}
    with scratch_dir() as scratch:
        for round_index in range(args.rounds):
            for layout in args.layouts:
                for mode in ("eager", "compiled"):
                    worker_args = ["--worker", layout, "1" if mode == "compiled" else "0", "--steps", str(args.steps), "--warmup", str(args.warmup)]
                    (result,) = run_worker_copies(Path(__file__), worker_args, [scratch / f"{layout}-{mode}-{time.monotonic_ns()}.json"])
                    runs[layout][mode].append(result)
                    print(f"round {round_index + 1}/{args.rounds} {layout} {mode}: median step {median_step(result) * 1e3:.1f} ms", flush=True)
    rows, summary = [], {}
    for layout, modes in runs.items():
        eager = statistics.median(median_step(r) for r in modes["eager"])
        compiled = statistics.median(median_step(r) for r in modes["compiled"])
        compile_s = statistics.median(r["warmup_s"] for r in modes["compiled"]) - statistics.median(r["warmup_s"] for r in modes["eager"])
        graphs, breaks = max(r["graphs"] for r in modes["compiled"]), max(r["graph_breaks"] for r in modes["compiled"])
        summary[layout] = {"eager_step_s": eager, "compiled_step_s": compiled, "ratio": compiled / eager, "compile_s": compile_s,
                           "graphs": graphs, "graph_breaks": breaks}
        rows.append(f"| {layout} | {eager * 1e3:.1f} | {compiled * 1e3:.1f} | **{compiled / eager:.3f}** | {compile_s:.1f} | {graphs} / {breaks} |")
    layouts = "" if args.layouts == list(LAYOUTS) else f" --layouts {' '.join(args.layouts)}"
    command = f"python benchmarks/compile_speedup.py --rounds {args.rounds} --steps {args.steps}{layouts}"
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    lines = [
        "# compile: true against eager",
        "",
        f"Command: `{command}` · {machine}",
        "",
        (
            f"Setup: {SETUP}. Median step time after {args.warmup} warm-up steps, median over {args.rounds} rounds; "
            "compile time is the compiled run's warm-up time less the eager run's; graphs / breaks: dynamo's counts on "
            "rank 0 of the compiled run (identical blocks share a graph). Goal: ratio ≤ 0.85 for single and dp2. "
            "dp2+checkpointing: activation_checkpointing='auto' in both runs (checkpointed blocks, compiled or not)."
        ),
        "",
        "| layout | eager ms | compiled ms | compiled / eager | compile s | graphs / breaks |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "compile_speedup.md").write_text("\n".join(lines) + "\n")
    (args.results / "compile_speedup.json").write_text(json.dumps({"command": command, "machine": machine, "setup": SETUP, "layouts": summary}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
