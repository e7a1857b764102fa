"""Step time with ``compile: true`` against eager, for single, dp2, tp2 and pp2, side by side in one run.

    python benchmarks/compile_speedup.py        # ~10 min on 2 cores; writes benchmarks/results/compile_speedup.{md,json}

The recipe GPT (float32, 1 thread per process, gloo) under our strategies, each layout eager and with
each block compiled by inductor; the variants of a layout alternate within each round. Reported: the
median step time after warm-up, the ratio compiled / eager, and the compile time (the warm-up steps'
extra time over eager's). Goal on this CPU: compiled ≤ 0.85 × eager for single and dp2.
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

LAYOUTS = {"single": 1, "dp2": 2, "tp2": 2, "pp2": 2}
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
    options = {"compile": compiled}
    strategy = {
        "single": lambda: lp.DataParallelStrategy(**options),
        "dp2": lambda: lp.DataParallelStrategy(**options),
        "tp2": lambda: lp.TensorParallelStrategy(data_parallel_mode="replicate", **options),
        "pp2": lambda: lp.PipelineParallelStrategy(microbatches=4, **options),
    }[layout]()
    started = time.perf_counter()
    timer = StepTimer(out, warmup, extra={"layout": layout, "compiled": compiled})
    trainer = L.Trainer(
        accelerator="cpu", devices=LAYOUTS[layout], strategy=strategy, precision="32-true", max_steps=warmup + steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )
    L.seed_everything(0)
    module = GPTLightningModule(**MODEL, lr=1e-4)
    batch = BATCH * (2 if layout == "pp2" else 1)  # pp2: one replica trains the batch two dp ranks would
    data = CharCorpusDataModule(block_size=MODEL["block_size"], batch_size=batch, max_chars=200_000, shuffle=False)
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        result = json.loads(out.read_text())
        result["warmup_s"] = sum(timer.times[:warmup])
        result["wall_s"] = time.perf_counter() - started
        out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("LAYOUT", "COMPILED"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1] == "1", args.steps, args.warmup, args.out)
        return
    runs: dict[str, dict[str, list[dict]]] = {layout: {"eager": [], "compiled": []} for layout in LAYOUTS}
    with scratch_dir() as scratch:
        for round_index in range(args.rounds):
            for layout in LAYOUTS:
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
        summary[layout] = {"eager_step_s": eager, "compiled_step_s": compiled, "ratio": compiled / eager, "compile_s": compile_s}
        rows.append(f"| {layout} | {eager * 1e3:.1f} | {compiled * 1e3:.1f} | **{compiled / eager:.3f}** | {compile_s:.1f} |")
    command = f"python benchmarks/compile_speedup.py --rounds {args.rounds} --steps {args.steps}"
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    lines = [
        "# compile: true against eager",
        "",
        f"Command: `{command}` · {machine}",
        "",
        f"Setup: {SETUP}. Median step time after {args.warmup} warm-up steps, median over {args.rounds} rounds; compile "
        "time is the compiled run's warm-up time less the eager run's. Goal: ratio ≤ 0.85 for single and dp2.",
        "",
        "| layout | eager ms | compiled ms | compiled / eager | compile s |",
        "|---|---|---|---|---|",
        *rows,
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compile_speedup.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "compile_speedup.json").write_text(json.dumps({"command": command, "machine": machine, "setup": SETUP, "layouts": summary}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
