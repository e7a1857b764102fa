"""Pipeline efficiency on 2 ranks against theory: PipelineParallelStrategy vs Lightning's single device.

    python benchmarks/pp_efficiency.py      # ~10 min on 2 cores; writes benchmarks/results/pp_efficiency.{md,json}

The recipe GPT (float32, 8 blocks) trains with the same global batch on one process × 1 thread
(Lightning's SingleDeviceStrategy) and as a 2-stage pipeline on 2 processes × 1 thread (gloo) for each
schedule and m = 2, 4, 8, 16 micro-batches. Two single-device baselines: the whole batch at once, and the
same m micro-batches one after another (``accumulate_grad_batches=m``: the same math and the same matmul
sizes as the pipeline, since small micro-batches run much less efficiently on a CPU). Reported per run:

- speedup over the whole-batch single device, S = T_single / T_pipeline;
- pipeline efficiency E = T_single(m micro-batches) / (p · T_pipeline): what the pipeline achieves over
  running its own micro-batches on one device, against the ideal if only the bubble cost time:
  m / (m + p − 1) for GPipe/1F1B, m·v / (m·v + p − 1) with v virtual stages for interleaved/looped, 1 for
  the zero-bubble ones; the rest of the gap is communication (activations cross processes through gloo),
  per-micro-batch overhead and stage imbalance;
- per-rank parameter bytes relative to the whole model (target ≤ 0.55 for p = 2).
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

MODEL = {"vocab_size": 128, "block_size": 64, "n_layer": 8, "n_head": 4, "n_embd": 128}
#: ``--smoke``: four blocks 32 wide (two per virtual stage of an interleaved schedule).
SMOKE_MODEL = {**MODEL, "n_layer": 4, "n_embd": 32}
BATCH = 32
STAGES = 2
SCHEDULES = {  # name -> virtual stages per rank
    "gpipe": 1,
    "1f1b": 1,
    "interleaved_1f1b": 2,
    "looped_bfs": 2,
    "interleaved_zero_bubble": 2,
    "zbv_zero_bubble": 2,
    "dualpipev": 2,
}
MICROBATCHES = (2, 4, 8, 16)
SETUP = (
    f"recipe GPT {MODEL['n_layer']}×{MODEL['n_embd']} (1.6M parameters), block {MODEL['block_size']}, batch {BATCH}, "
    f"float32; single device = 1 process × 1 thread; pipeline = {STAGES} processes × 1 thread, gloo"
)


READING = (
    'Reading the numbers: the traced stages themselves are not the cost (forward+backward of half this '
    'model on 8 sequences: 77–83 ms traced against ~85 ms for the same eager blocks, alternating runs on '
    'one thread). The gap between measured and ideal efficiency comes from (1) gloo moving activations '
    'and their gradients between processes through memory copies, plus per-micro-batch work outside the '
    "model (the user's step on the last stage, schedule bookkeeping); (2) two busy processes sharing two "
    "cores' caches and memory bandwidth, while the single-device baseline runs alone (the data-parallel "
    'benchmark shows the same effect); (3) run-to-run noise of this 2-core VM (±10% between repeated '
    'single-device runs). The zero-bubble schedules split backward into input and weight gradients, which '
    'on a CPU costs more than the bubble it removes. Parameter memory per rank is about half the model '
    '(tied embedding replicated on both stages).'
)


def ideal_efficiency(schedule: str, m: int, p: int = STAGES) -> float:
    """Efficiency if the bubble were the only cost (no communication, perfectly balanced stages)."""
    if "zero_bubble" in schedule or schedule == "dualpipev":
        return 1.0
    v = SCHEDULES[schedule]
    return m * v / (m * v + p - 1)


def median_accumulated_step(batch_times: list[float], m: int, warmup: int) -> float:
    """Median time of an optimizer step made of m micro-batch ends (the optimizer step included)."""
    # StepTimer dropped `warmup` batch ends: realign to whole steps before grouping.
    skip = (-warmup) % m
    times = batch_times[skip:]
    steps = [sum(times[i : i + m]) for i in range(0, len(times) - m + 1, m)]
    return statistics.median(steps)


def worker(variant: str, microbatches: int, steps: int, warmup: int, out: Path, smoke: bool = False) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_parallel import PipelineParallelStrategy
    from recipes.data.chars import CharCorpusDataModule
    from recipes.models.gpt import GPTLightningModule

    torch.set_num_threads(1)
    L.seed_everything(0)
    accumulate, batch = 1, BATCH
    if variant == "single":
        # m > 1: the same micro-batches as the pipeline, one after another.
        strategy, devices, accumulate, batch = "auto", 1, microbatches, BATCH // microbatches
    else:
        strategy = PipelineParallelStrategy(
            STAGES, schedule=variant, microbatches=microbatches, stages_per_rank=SCHEDULES[variant]
        )
        devices = STAGES

    class ParameterBytes(L.Callback):
        def on_train_end(self, trainer, pl_module):
            local = sum(p.numel() * p.element_size() for p in pl_module.parameters())
            per_rank = [local]
            if dist.is_initialized():
                per_rank = [None] * dist.get_world_size()
                dist.all_gather_object(per_rank, local)
            timer.extra.update({"variant": variant, "microbatches": microbatches, "param_bytes_per_rank": per_rank})

    timer = StepTimer(out, warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps + warmup, accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[ParameterBytes(), timer],
    )
    data = CharCorpusDataModule(block_size=MODEL["block_size"], batch_size=batch, max_chars=20_000 if smoke else 400_000)
    trainer.fit(GPTLightningModule(**(SMOKE_MODEL if smoke else MODEL)), datamodule=data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--microbatches", default=",".join(map(str, MICROBATCHES)))
    parser.add_argument("--smoke", action="store_true",
                        help="a 4×32 GPT, 1f1b and interleaved_1f1b at m=2, 1 timed step (use with --results)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for pp_efficiency.{md,json}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--m", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.m, args.steps, args.warmup, args.out, args.smoke)
        return
    if args.smoke:
        args.steps, args.warmup, args.schedules, args.microbatches = 1, 1, "1f1b,interleaved_1f1b", "2"
    results = args.results

    def run(variant: str, m: int, required: bool = False) -> dict | str:
        worker_args = ["--worker", variant, "--m", str(m), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        worker_args += ["--smoke"] if args.smoke else []
        ranks = 1 if variant == "single" else STAGES
        try:
            (result,) = run_worker_copies(Path(__file__), worker_args, [scratch / f"{variant}-{time.monotonic_ns()}.json"], ranks)
        except RuntimeError as error:
            if required or args.smoke:  # a smoke run checks that every schedule it asks for runs
                raise
            return str(error).strip().splitlines()[-1]  # a schedule that cannot run this m: reported, not fatal
        return result

    schedules = args.schedules.split(",")
    counts = [int(m) for m in args.microbatches.split(",")]
    rows = []
    with scratch_dir(results) as scratch:
        single = run("single", 1, required=True)
        t_single = median_step(single)
        whole_bytes = single["param_bytes_per_rank"][0]
        print(f"single device: median step {t_single * 1e3:.1f} ms", flush=True)
        t_micro = {}
        for m in counts:
            micro = run("single", m, required=True)
            t_micro[m] = median_accumulated_step(micro["step_times"], m, args.warmup)
            print(f"single device, {m} micro-batches of {BATCH // m}: {t_micro[m] * 1e3:.1f} ms per step", flush=True)
        for schedule in schedules:
            for m in counts:
                result = run(schedule, m)
                row = {"schedule": schedule, "microbatches": m, "ideal_efficiency": ideal_efficiency(schedule, m)}
                if isinstance(result, str):
                    row["error"] = result
                else:
                    t = median_step(result)
                    row.update(
                        step_s=t, single_same_microbatches_s=t_micro[m], speedup=t_single / t,
                        efficiency=t_micro[m] / t / STAGES,
                        param_share_per_rank=[b / whole_bytes for b in result["param_bytes_per_rank"]],
                    )
                rows.append(row)
                shown = row.get("error") or f"step {row['step_s'] * 1e3:7.1f} ms, efficiency {row['efficiency']:.2f} (ideal {row['ideal_efficiency']:.2f})"
                print(f"{schedule:24s} m={m:2d}: {shown}", flush=True)

    measured = [r for r in rows if "error" not in r]
    summary = {
        "command": f"python benchmarks/pp_efficiency.py --steps {args.steps} --warmup {args.warmup}",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "setup": f"smoke: recipe GPT {SMOKE_MODEL}" if args.smoke else SETUP,
        "single_device_step_s": t_single,
        "single_device_microbatched_step_s": t_micro,
        "runs": rows,
        "max_param_share_per_rank": max(max(r["param_share_per_rank"]) for r in measured) if measured else None,
    }
    (results / "pp_efficiency.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        "# Pipeline efficiency on 2 ranks: PipelineParallelStrategy vs single device",
        "",
        f"Command: `{summary['command']}` · {summary['machine']}",
        "",
        f"Setup: {summary['setup']}. Median step time after {args.warmup} warm-up steps. Single device, whole batch: "
        f"{t_single * 1e3:.1f} ms per step; the same m micro-batches one after another: "
        + ", ".join(f"m={m}: {t * 1e3:.0f} ms" for m, t in t_micro.items())
        + ". Speedup = single whole batch / pipeline. Efficiency = single with the same micro-batches / (2 × pipeline); "
        "ideal = bubble-only bound (m/(m+p−1) GPipe/1F1B, m·v/(m·v+p−1) interleaved/looped, 1 zero-bubble).",
        "",
        "| schedule | m | step (ms) | speedup | efficiency | ideal | measured / ideal | parameter share per rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['schedule']} | {r['microbatches']} | — | — | — | {r['ideal_efficiency']:.2f} | — | n/a: {r['error'][:120]} |")
        else:
            shares = " / ".join(f"{s:.2f}" for s in r["param_share_per_rank"])
            lines.append(
                f"| {r['schedule']} | {r['microbatches']} | {r['step_s'] * 1e3:.1f} | {r['speedup']:.2f} | {r['efficiency']:.2f} | "
                f"{r['ideal_efficiency']:.2f} | {r['efficiency'] / r['ideal_efficiency']:.2f} | {shares} |"
            )
    if measured:
        best = max(measured, key=lambda r: r["efficiency"])
        lines += [
            "",
            (
                f"Best: {best['schedule']} with m={best['microbatches']} at efficiency {best['efficiency']:.2f}. "
                f"Largest per-rank parameter share: {summary['max_param_share_per_rank']:.3f} of the whole model. "
                f"Median measured/ideal: {statistics.median(r['efficiency'] / r['ideal_efficiency'] for r in measured):.2f}. "
                "Raw figures: pp_efficiency.json."
            ),
        ]
    lines += ["", READING, ""]
    (results / "pp_efficiency.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
