"""One-GPU check: step time, tokens/s, MFU and peak memory of the recipe's gpt_1b, ours against Lightning.

    python benchmarks/gpu_check.py            # on one CUDA GPU, under 8 minutes; writes benchmarks/results/gpu_check.{md,json}
    python benchmarks/gpu_check.py --smoke    # on the CPU: a tiny model, 2 steps, 3 of the variants (the test suite runs this)

World size 1, ``bf16-mixed``, sequence length 2048, random tokens: Lightning's ``SingleDeviceStrategy``
against our ``DataParallelStrategy`` (one device), eager and ``compile: true``, with activation
checkpointing off and on. Each variant runs in a fresh process (so its peak memory is its own). MFU =
model FLOPs (the planner's dry run: forward + backward, recomputation not counted) × samples per second /
the device's dense bf16 peak (a table by device name; ``--peak-tflops`` overrides it). Never run by CI on
a GPU; ``--smoke`` keeps it from rotting.

It also calibrates the planner: the datasheet profile of this GPU (``conf/hardware/<profile>.yaml``, by device name)
is written again as ``conf/hardware/<profile>_calibrated.yaml`` with ``achievable_fraction`` set to the MFU our
eager ``DataParallelStrategy`` measured (the planner's GPU step time is FLOPs at that fraction of the peak), so that
``hardware=<profile>_calibrated`` predicts from this machine's own figure. ``--smoke`` writes the calibrated
profile beside its report instead (from ``cpu_local``'s layout), to keep the path tested.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks.*` importable

from benchmarks.common import RESULTS

#: Variant -> (strategy, compile, activation checkpointing).
VARIANTS: dict[str, tuple[str, bool, bool]] = {
    "Lightning SingleDeviceStrategy": ("lightning", False, False),
    "ours DataParallelStrategy": ("ours", False, False),
    "ours + compile": ("ours", True, False),
    "ours + activation checkpointing": ("ours", False, True),
    "ours + compile + activation checkpointing": ("ours", True, True),
}
#: What --smoke runs: every code path (Lightning's baseline, ours, compile with checkpointing) at least once.
SMOKE_VARIANTS = ("Lightning SingleDeviceStrategy", "ours DataParallelStrategy", "ours + compile + activation checkpointing")
#: Dense peaks (TFLOP/s) by a substring of the CUDA device name: bf16, fp32 (no TF32).
GPU_PEAKS = {"H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5), "L40S": (362.0, 91.6)}
#: The datasheet profile (conf/hardware/<name>.yaml) by a substring of the CUDA device name.
GPU_PROFILES = {"H200": "h100_ib", "H100": "h100_ib", "A100": "a100_ib", "L40S": "l40s_ethernet"}
#: The variant whose MFU calibrates the planner (eager, no recomputation: what the planner's step time counts).
CALIBRATING_VARIANT = "ours DataParallelStrategy"
HARDWARE_DIR = Path(__file__).resolve().parents[1] / "conf" / "hardware"
FULL = {"model": {"vocab_size": 128, "block_size": 2048, "n_layer": 24, "n_head": 16, "n_embd": 2048}, "batch": 4,
        "steps": 12, "warmup": 3, "precision": "bf16-mixed"}
SMOKE = {"model": {"vocab_size": 128, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}, "batch": 2,
         "steps": 2, "warmup": 1, "precision": "32-true"}


def worker(variant: str, setup: dict[str, Any], peak_tflops: float | None, out: Path) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_parallel import DataParallelStrategy
    from lightning_parallel.observe.utilization import (
        model_flops_per_sample,
        training_dtype,
    )
    from lightning_parallel.plan.profile import profile_model
    from recipes.models.gpt import GPTLightningModule

    strategy_name, compiled, checkpointed = VARIANTS[variant]
    cuda = torch.cuda.is_available()
    model_config, batch, steps, warmup = setup["model"], setup["batch"], setup["steps"], setup["warmup"]
    tokens = torch.randint(0, model_config["vocab_size"], ((steps + warmup) * batch, model_config["block_size"] + 1),
                           generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)

    def build() -> GPTLightningModule:
        return GPTLightningModule(**model_config, dropout=0.0, lr=1e-4)

    example = next(iter(data))
    flops_per_sample = model_flops_per_sample(profile_model(build, example))
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if strategy_name == "lightning":
        strategy: Any = SingleDeviceStrategy(device=device)
        if checkpointed or compiled:
            raise ValueError("the Lightning variant runs eagerly without checkpointing (its baseline)")
    else:
        strategy = DataParallelStrategy(compile=compiled, activation_checkpointing="auto" if checkpointed else None)
    times: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    trainer = L.Trainer(
        accelerator="cuda" if cuda else "cpu", devices=1, strategy=strategy, precision=setup["precision"],
        max_steps=steps + warmup, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timer()],
    )
    with trainer.init_module():
        module = build()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.fit(module, train_dataloaders=data)
    step_s = statistics.median(times[warmup:])
    dtype = training_dtype(setup["precision"])
    if peak_tflops is None:
        if cuda:
            name = torch.cuda.get_device_name(0)
            peaks = next((p for key, p in GPU_PEAKS.items() if key in name), None)
            if peaks is None:
                raise ValueError(f"no peak known for {name!r}: pass --peak-tflops")
            peak_tflops = peaks[0] if dtype == "bf16" else peaks[1]
        else:
            from lightning_parallel.measure.peak import measured_matmul_tflops

            peak_tflops = measured_matmul_tflops(dtype)
    samples_per_s = batch / step_s
    result = {
        "variant": variant,
        "step_s": step_s,
        "first_steps_s": sum(times[:warmup]),  # includes compilation
        "wall_s": time.perf_counter() - started,
        "tokens_per_s": samples_per_s * model_config["block_size"],
        "mfu": flops_per_sample * samples_per_s / (peak_tflops * 1e12),
        "peak_tflops": peak_tflops,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
    }
    out.write_text(json.dumps(result))


def run(smoke: bool, peak_tflops: float | None, out_dir: Path, timeout: float) -> dict[str, dict[str, Any]]:
    setup = SMOKE if smoke else FULL
    results = {}
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK")}
    for variant in SMOKE_VARIANTS if smoke else VARIANTS:
        out = out_dir / f"{len(results)}.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, json.dumps(setup), str(out)]
        if peak_tflops is not None:
            command += ["--peak-tflops", str(peak_tflops)]
        proc = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            results[variant] = {"variant": variant, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
        else:
            results[variant] = json.loads(out.read_text())
        print(variant, results[variant], flush=True)
    return results


def write_report(results: dict[str, dict[str, Any]], smoke: bool) -> str:
    setup = SMOKE if smoke else FULL
    baseline = results.get("Lightning SingleDeviceStrategy", {}).get("step_s")
    device = next((r["device"] for r in results.values() if "device" in r), "?")
    m = setup["model"]
    lines = [
        "# GPU check: gpt_1b on one device" if not smoke else "# GPU check (smoke, CPU)",
        "",
        f"`python benchmarks/gpu_check.py{' --smoke' if smoke else ''}` on {device}: recipe GPT {m['n_layer']}×{m['n_embd']}, "
        f"sequence {m['block_size']}, batch {setup['batch']}, {setup['precision']}, median of {setup['steps']} steps after "
        f"{setup['warmup']} warm-up steps (their time, compilation included, is in \"first steps\").",
        "",
        "| variant | step s | ratio to Lightning | tokens/s | MFU | peak memory GiB | first steps s |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, r in results.items():
        if "error" in r:
            lines.append(f"| {variant} | failed: {r['error']} | | | | | |")
            continue
        ratio = f"{r['step_s'] / baseline:.3f}" if baseline else "n/a"
        memory = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "n/a"
        lines.append(f"| {variant} | {r['step_s']:.4f} | {ratio} | {r['tokens_per_s']:.0f} | {r['mfu']:.1%} | {memory} | {r['first_steps_s']:.1f} |")
    return "\n".join(lines) + "\n"


def calibrated_profile(results: dict[str, dict[str, Any]], smoke: bool) -> tuple[str, str] | None:
    """``(file name, YAML text)`` of this GPU's datasheet profile with ``achievable_fraction`` measured, or ``None``
    where the calibrating variant failed or the device has no profile here."""
    import yaml

    measured = results.get(CALIBRATING_VARIANT, {})
    if "mfu" not in measured:
        return None
    base = "cpu_local" if smoke else next((p for key, p in GPU_PROFILES.items() if key in measured["device"]), None)
    if base is None:
        return None
    profile = yaml.safe_load((HARDWARE_DIR / f"{base}.yaml").read_text())
    fraction = min(1.0, measured["mfu"])
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    profile.update(name=f"{base}_calibrated", achievable_fraction=round(fraction, 4),
                   description=f"{profile.get('description', base)}; achievable_fraction measured by benchmarks/gpu_check.py "
                               f"on {measured['device']} ({stamp}): MFU of the recipe's gpt_1b under our eager DataParallelStrategy")
    header = (f"# Written by benchmarks/gpu_check.py: conf/hardware/{base}.yaml with achievable_fraction measured on this GPU\n"
              f"# (was {yaml.safe_load((HARDWARE_DIR / f'{base}.yaml').read_text()).get('achievable_fraction')}). Use: hardware={base}_calibrated\n")
    return f"{base}_calibrated.yaml", header + yaml.safe_dump(profile, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 2 steps per variant")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak in the training dtype")
    parser.add_argument("--out", type=Path, default=None, help="where the report goes (default: benchmarks/results/)")
    parser.add_argument("--worker", nargs=3, metavar=("VARIANT", "SETUP", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        variant, setup, out = args.worker
        worker(variant, json.loads(setup), args.peak_tflops, Path(out))
        return 0
    out_dir = args.out or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = out_dir / ".gpu_check"
    scratch.mkdir(exist_ok=True)
    results = run(args.smoke, args.peak_tflops, scratch, timeout=900)
    report = write_report(results, args.smoke)
    name = "gpu_check_smoke" if args.smoke else "gpu_check"
    (out_dir / f"{name}.md").write_text(report)
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=2))
    print(report)
    calibrated = calibrated_profile(results, args.smoke)
    if calibrated is not None:
        filename, text = calibrated
        target = (out_dir if args.smoke else HARDWARE_DIR) / filename
        target.write_text(text)
        print(f"calibrated hardware profile: {target}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
