"""One-GPU check (issue 52): MFU, memory and CUDA-event timings of a ~1B GPT, and every layout at 2 ranks on the GPU.

    python benchmarks/gpu_check.py            # one CUDA GPU (H100/H200), about 8 minutes; writes benchmarks/results/gpu_check.{md,json}
    python benchmarks/gpu_check.py --smoke    # on the CPU: a tiny model, 2 steps, 3 of the variants, 2 layouts (the test suite runs this)

**Not yet run on a GPU**: written and run on the CPU only (``--smoke``; the layouts' CPU path is the GPU's over plain
gloo). Without a CUDA GPU, or on a GPU that :mod:`lightning_parallel.plan.gpus` does not know (and no
``--peak-tflops``), it stops before training anything, saying why (exit status 2).

1. The GPU, by the name CUDA reports, from the catalogue (:mod:`lightning_parallel.plan.gpus`): its dense peaks, its
   memory (set beside what the device reports) and its hardware profile (``lightning_parallel/conf/hardware/<profile>.yaml``).
2. Every layout at 2 ranks sharing the GPU over a ``cuda:gloo`` group (NCCL refuses two ranks on one GPU; a CUDA-only
   group keeps NCCL's rule that host tensors are refused), in float32, against Lightning's single device on the same
   GPU: dp2, dp2 sharded (FSDP2), tp2, pp2, cp2 and dp2 × ep2 (:mod:`benchmarks.gpu_layouts`; all launches at once).
3. The recipe's gpt_1b (24 × 2048, ~1.2B parameters), world size 1, ``bf16-mixed``, sequence length 2048, random
   tokens: Lightning's ``SingleDeviceStrategy`` against our ``DataParallelStrategy`` (one device), eager and
   ``compile: true``, with activation checkpointing off and on, each in a fresh process (so its peak memory is its
   own). Per variant: step time (host clock around a synchronized step), the ``ScalingMonitor``'s step time (CUDA
   events) beside it, tokens/s, MFU (model FLOPs from the planner's dry run, forward + backward, recomputation not
   counted, × samples per second / the catalogue's dense bf16 peak; ``--peak-tflops`` overrides it; the goal for the
   compiled variant is 40%), and CUDA peak memory measured (``torch.cuda.max_memory_allocated``) against the
   planner's prediction for the same layout.

The whole run keeps to ``--budget-s`` (default 450 s): a part that would start after it is reported as skipped, and one
still running at the end is killed. It also calibrates the planner: the GPU's datasheet profile is written again as
``conf/hardware/<profile>_calibrated.yaml`` with ``achievable_fraction`` set to the MFU our eager
``DataParallelStrategy`` measured (the planner's GPU step time is FLOPs at that fraction of the peak), so that
``hardware=<profile>_calibrated`` predicts from this machine's own figure. ``--smoke`` writes the calibrated profile
beside its report instead (from ``cpu_local``'s layout), to keep the path tested.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks.*` importable

from benchmarks import gpu_layouts
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
#: The variant whose MFU calibrates the planner (eager, no recomputation: what the planner's step time counts).
CALIBRATING_VARIANT = "ours DataParallelStrategy"
#: The variant whose MFU issue 52 sets a goal for, and the goal.
HEADLINE_VARIANT, MFU_GOAL = "ours + compile", 0.40
#: The library's datasheet profiles (read), and the recipe's own hardware group, where a calibrated profile is written:
#: it describes this machine, not a GPU model, so it stays out of the package (the recipe finds both by name).
HARDWARE_DIR = Path(__file__).resolve().parents[1] / "lightning_parallel" / "conf" / "hardware"
CALIBRATED_DIR = Path(__file__).resolve().parents[1] / "conf" / "hardware"
FULL = {"model": {"vocab_size": 128, "block_size": 2048, "n_layer": 24, "n_head": 16, "n_embd": 2048}, "batch": 4,
        "steps": 12, "warmup": 3, "precision": "bf16-mixed"}
SMOKE = {"model": {"vocab_size": 128, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}, "batch": 2,
         "steps": 2, "warmup": 1, "precision": "32-true"}
#: The profile --smoke predicts memory with (a datasheet one: its times mean nothing on a CPU, and the memory
#: predicted does not depend on them; cpu_local would measure this machine first).
SMOKE_HARDWARE = "h100_ib"
#: Seconds the whole check may take (issue 52: at most 8 minutes on one GPU, start-up and report included).
BUDGET_S = 450.0
#: Of those, seconds the layouts may take (their launches run at once; ~1 min on a CPU of 2 cores).
LAYOUTS_BUDGET_S = 150.0
#: A variant is not started with fewer seconds than this left (it could not finish: reported as skipped).
MIN_VARIANT_S = 30.0


class GPUCheckError(RuntimeError):
    """The check cannot run here (no CUDA GPU, or no peak known for it); the message says why and what to do."""


def gpu_info(peak_tflops: float | None) -> dict[str, Any]:
    """The GPU this check runs on: name, what it reports, and the catalogue's figures for it.

    Raises:
        GPUCheckError: No CUDA GPU, or one the catalogue does not know and no ``peak_tflops`` given.
    """
    import torch

    from lightning_parallel.plan.gpus import UnknownGPUError, find_gpu, gpu_spec

    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        raise GPUCheckError(
            f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, {built}). The check trains a "
            f"1B model and 2-rank layouts on one NVIDIA GPU; run it on a machine with one, or `python "
            f"benchmarks/gpu_check.py --smoke` for its CPU smoke test."
        )
    name = torch.cuda.get_device_name(0)
    properties = torch.cuda.get_device_properties(0)
    spec = find_gpu(name)
    if spec is None and peak_tflops is None:
        try:
            gpu_spec(name)
        except UnknownGPUError as error:
            raise GPUCheckError(str(error)) from None
    return {
        "name": name,
        "reported_memory_gib": properties.total_memory / 2**30,
        "capability": f"{properties.major}.{properties.minor}",
        "devices_visible": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "catalogue": None if spec is None else {
            "key": spec.key, "model": spec.model, "bf16_tflops": spec.bf16_tflops, "memory_gb": spec.memory_gb,
            "memory_gbps": spec.memory_gbps, "nvlink_gbps": spec.nvlink_gbps, "profile": spec.profile,
        },
    }


def _hardware(name: str | None) -> Any:
    """``conf/hardware/<name>.yaml`` as a HardwareProfile (``None`` for ``None``)."""
    if name is None:
        return None
    import yaml

    from lightning_parallel.plan.hardware import HardwareProfile

    return HardwareProfile.from_config(yaml.safe_load((HARDWARE_DIR / f"{name}.yaml").read_text()))


def worker(variant: str, setup: dict[str, Any], peak_tflops: float | None, out: Path) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_parallel import DataParallelStrategy, ScalingMonitor
    from lightning_parallel.observe.utilization import (
        model_flops_per_sample,
        training_dtype,
    )
    from lightning_parallel.plan.gpus import gpu_spec
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
    model_profile = profile_model(build, example)
    flops_per_sample = model_flops_per_sample(model_profile)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if strategy_name == "lightning":
        strategy: Any = SingleDeviceStrategy(device=device)
        if checkpointed or compiled:
            raise ValueError("the Lightning variant runs eagerly without checkpointing (its baseline)")
    else:
        strategy = DataParallelStrategy(compile=compiled, activation_checkpointing="auto" if checkpointed else None)
    times: list[float] = []

    class Timer(L.Callback):
        """Host clock around each step, the device synchronized at both ends (what the monitor's events time)."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)

    # First, so that its marks are recorded before the timer synchronizes: both time the same stretch of the stream.
    monitor = ScalingMonitor(hardware=_hardware(setup.get("hardware")), profile=model_profile, warmup_steps=warmup,
                             output_dir=out.parent / f"monitor-{out.stem}")
    trainer = L.Trainer(
        accelerator="cuda" if cuda else "cpu", devices=1, strategy=strategy, precision=setup["precision"],
        max_steps=steps + warmup, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[monitor, Timer()],
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
            peak_tflops = gpu_spec(torch.cuda.get_device_name(0)).peak_tflops(dtype, tf32=torch.backends.cuda.matmul.allow_tf32)
        else:
            from lightning_parallel.measure.peak import measured_matmul_tflops

            peak_tflops = measured_matmul_tflops(dtype)
    samples_per_s = batch / step_s
    measured = monitor.summary.get("measured") or {}
    predicted = monitor.summary.get("predicted") or {}
    result = {
        "variant": variant,
        "step_s": step_s,
        "monitor_step_s": measured.get("step_s"),  # mean of the CUDA-event (on a CPU: host-clock) step times
        "first_steps_s": sum(times[:warmup]),  # includes compilation
        "wall_s": time.perf_counter() - started,
        "tokens_per_s": samples_per_s * model_config["block_size"],
        "mfu": flops_per_sample * samples_per_s / (peak_tflops * 1e12),
        "peak_tflops": peak_tflops,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "monitor_peak_memory_gib": measured["peak_memory_bytes"] / 2**30 if "peak_memory_bytes" in measured else None,
        "predicted_peak_memory_gib": predicted["peak_memory_bytes"] / 2**30 if "peak_memory_bytes" in predicted else None,
        "predicted_step_s": (predicted.get("seconds") or {}).get("step"),
        "hardware": setup.get("hardware"),
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
    }
    out.write_text(json.dumps(result))


def run(smoke: bool, peak_tflops: float | None, out_dir: Path, deadline: float, hardware: str | None) -> dict[str, dict[str, Any]]:
    """Each variant in a fresh process, one after another, while ``deadline`` (``time.monotonic()``) allows."""
    setup = {**(SMOKE if smoke else FULL), "hardware": hardware}
    results: dict[str, dict[str, Any]] = {}
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK")}
    for variant in SMOKE_VARIANTS if smoke else VARIANTS:
        left = deadline - time.monotonic()
        if left < MIN_VARIANT_S:
            results[variant] = {"variant": variant, "error": f"skipped: {left:.0f} s of the time budget (--budget-s) left"}
            print(variant, results[variant], flush=True)
            continue
        out = out_dir / f"{len(results)}.json"
        out.unlink(missing_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, json.dumps(setup), str(out)]
        if peak_tflops is not None:
            command += ["--peak-tflops", str(peak_tflops)]
        returncode, stderr = gpu_layouts.run_in_session(command, env, timeout=left)
        if returncode is None:
            results[variant] = {"variant": variant, "error": f"killed after {left:.0f} s: the time budget (--budget-s) ran out"}
        elif returncode != 0 or not out.exists():
            results[variant] = {"variant": variant, "error": gpu_layouts.last_error(stderr, returncode)}
        else:
            results[variant] = json.loads(out.read_text())
        print(variant, results[variant], flush=True)
    return results


def _gib(value: float | None) -> str:
    return f"{value:.3g}" if value is not None else "n/a"  # 30.2 on a GPU, 0.0012 for the smoke test's tiny model


def write_report(results: dict[str, Any], smoke: bool) -> str:
    """The Markdown report of :func:`main`'s results (``device``, ``variants``, ``layouts``, ``wall_s``)."""
    setup = SMOKE if smoke else FULL
    variants, layouts, gpu = results["variants"], results["layouts"], results.get("device")
    baseline = variants.get("Lightning SingleDeviceStrategy", {}).get("step_s")
    device = next((r["device"] for r in variants.values() if "device" in r), "?")
    m = setup["model"]
    lines = ["# GPU check: gpt_1b on one device" if not smoke else "# GPU check (smoke, CPU)", ""]
    if gpu is not None:
        spec = gpu["catalogue"]
        known = (f"catalogue: {spec['model']}, dense bf16 {spec['bf16_tflops']:g} TFLOP/s, {spec['memory_gb']:g} GB, "
                 f"profile {spec['profile'] or 'none'}") if spec else "not in the catalogue (peak from --peak-tflops)"
        reported = gpu["reported_memory_gib"]
        lines += [(f"Device: {gpu['name']} ({known}); the device reports {reported:.1f} GiB, compute capability "
                   f"{gpu['capability']}; torch {gpu['torch']}, CUDA {gpu['cuda']}. Whole check: {results['wall_s']:.0f} s."), ""]
    profile = next((r["hardware"] for r in variants.values() if r.get("hardware")), "no profile")
    lines += [
        (f"`python benchmarks/gpu_check.py{' --smoke' if smoke else ''}` on {device}: recipe GPT {m['n_layer']}×{m['n_embd']}, "
         f"sequence {m['block_size']}, batch {setup['batch']}, {setup['precision']}, median of {setup['steps']} steps after "
         f"{setup['warmup']} warm-up steps (their time, compilation included, is in \"first steps\"). \"monitor\": the "
         f"ScalingMonitor's mean step time (CUDA events on a GPU); memory: `torch.cuda.max_memory_allocated` against the "
         f"planner's prediction for the layout ({profile})."),
        "",
        "| variant | step s | monitor step s | ratio to Lightning | tokens/s | MFU | peak memory GiB | predicted GiB | first steps s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, r in variants.items():
        if "error" in r:
            lines.append(f"| {variant} | {'' if r['error'].startswith('skipped') else 'failed: '}{r['error']} | | | | | | | |")
            continue
        ratio = f"{r['step_s'] / baseline:.3f}" if baseline else "n/a"
        monitor = f"{r['monitor_step_s']:.4f}" if r.get("monitor_step_s") is not None else "n/a"
        memory = r["peak_memory_gib"] if r["peak_memory_gib"] is not None else r.get("monitor_peak_memory_gib")
        lines.append(f"| {variant} | {r['step_s']:.4f} | {monitor} | {ratio} | {r['tokens_per_s']:.0f} | {r['mfu']:.1%} | "
                     f"{_gib(memory)} | {_gib(r.get('predicted_peak_memory_gib'))} | {r['first_steps_s']:.1f} |")
    headline = variants.get(HEADLINE_VARIANT, {})
    if not smoke and "mfu" in headline:
        verdict = "met" if headline["mfu"] >= MFU_GOAL else "not met"
        lines += ["", f"Compiled MFU ({HEADLINE_VARIANT}): {headline['mfu']:.1%}; goal ≥ {MFU_GOAL:.0%}: {verdict}."]
    lines += ["", "## Every layout at 2 ranks on this device", "", *gpu_layouts.report_lines(layouts)]
    return "\n".join(lines) + "\n"


def calibrated_profile(results: dict[str, dict[str, Any]], smoke: bool) -> tuple[str, str] | None:
    """``(file name, YAML text)`` of this GPU's datasheet profile with ``achievable_fraction`` measured, or ``None``
    where the calibrating variant failed or the device has no profile here (``results``: by variant)."""
    import yaml

    from lightning_parallel.plan.gpus import find_gpu

    measured = results.get(CALIBRATING_VARIANT, {})
    if "mfu" not in measured:
        return None
    spec = None if smoke else find_gpu(measured["device"])
    base = "cpu_local" if smoke else (spec.profile if spec is not None else None)
    if base is None:
        return None
    profile = yaml.safe_load((HARDWARE_DIR / f"{base}.yaml").read_text())
    fraction = min(1.0, measured["mfu"])
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    profile.update(name=f"{base}_calibrated", achievable_fraction=round(fraction, 4),
                   description=f"{profile.get('description', base)}; achievable_fraction measured by benchmarks/gpu_check.py "
                               f"on {measured['device']} ({stamp}): MFU of the recipe's gpt_1b under our eager DataParallelStrategy")
    header = (f"# Written by benchmarks/gpu_check.py: lightning_parallel/conf/hardware/{base}.yaml with achievable_fraction measured on this GPU\n"
              f"# (was {yaml.safe_load((HARDWARE_DIR / f'{base}.yaml').read_text()).get('achievable_fraction')}). Use: hardware={base}_calibrated\n")
    return f"{base}_calibrated.yaml", header + yaml.safe_dump(profile, sort_keys=False)


def failed(results: dict[str, Any]) -> bool:
    """Whether any variant failed (or was skipped) or any layout failed or differed from the single device."""
    return any("error" in r for r in results["variants"].values()) or not all(r.get("match") for r in results["layouts"].values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 2 steps per variant, 2 layouts")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak in the training dtype")
    parser.add_argument("--out", type=Path, default=None, help="where the report goes (default: benchmarks/results/)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds the whole check may take")
    parser.add_argument("--worker", nargs=3, metavar=("VARIANT", "SETUP", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        variant, setup, out = args.worker
        worker(variant, json.loads(setup), args.peak_tflops, Path(out))
        return 0
    started = time.monotonic()
    deadline = started + args.budget_s
    gpu = None
    if not args.smoke:
        try:
            gpu = gpu_info(args.peak_tflops)
        except GPUCheckError as error:
            print(f"gpu_check: {error}", file=sys.stderr)
            return 2
    hardware = SMOKE_HARDWARE if args.smoke else (gpu["catalogue"] or {}).get("profile")
    out_dir = args.out or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = out_dir / ".gpu_check"
    scratch.mkdir(exist_ok=True)
    names = gpu_layouts.SMOKE_LAYOUTS if args.smoke else tuple(gpu_layouts.LAYOUTS)
    layouts = gpu_layouts.run_layouts(names, scratch / "layouts", min(deadline, time.monotonic() + LAYOUTS_BUDGET_S))
    print("\n".join(gpu_layouts.report_lines(layouts)), flush=True)
    variants = run(args.smoke, args.peak_tflops, scratch, deadline, hardware)
    results = {"device": gpu, "variants": variants, "layouts": layouts, "wall_s": time.monotonic() - started,
               "budget_s": args.budget_s}
    report = write_report(results, args.smoke)
    name = "gpu_check_smoke" if args.smoke else "gpu_check"
    (out_dir / f"{name}.md").write_text(report)
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=2))
    print(report)
    calibrated = calibrated_profile(variants, args.smoke)
    if calibrated is not None:
        filename, text = calibrated
        target = (out_dir if args.smoke else CALIBRATED_DIR) / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"calibrated hardware profile: {target}")
    return 1 if failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
