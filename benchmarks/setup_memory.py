"""Peak memory each rank adds while the model is built and set up, as a fraction of the whole model.

    python benchmarks/setup_memory.py            # ~4 min on 2 cores; writes benchmarks/results/setup_memory.{md,json}

A model that does not fit on one device can only be trained if no rank ever holds all of it, setup
included. Each variant runs in fresh processes (2–8 ranks on the CPU, gloo, float32): the peak resident
memory (``VmHWM``, reset just before the model is built) minus the resident memory at that moment, when
training is about to start (for pipelines: when this rank's stages are built and initialised, on the
first batch). Our strategies build the model under ``trainer.init_module(empty_init=True)`` (parameters
on the meta device; each rank allocates and initialises only its part) or eagerly; Lightning's
``DDPStrategy`` holds the whole model on every rank by design, and its ``ModelParallelStrategy`` with
FSDP2 applied in ``configure_model`` (Lightning's documented way for large models) materialises
shards after ``fully_shard``. Lightning's ``FSDPStrategy`` does not run on the CPU and is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks.*` importable

from benchmarks.common import RESULTS, scratch_dir

#: Variant -> (strategy, devices, build under init_module(empty_init=True), model).
VARIANTS: dict[str, tuple[str, int, bool, str]] = {
    "ours tp2 (meta init)": ("tp2", 2, True, "dense"),
    "ours pp2 (meta init)": ("pp2", 2, True, "dense"),
    "ours dp2 shard (meta init)": ("dp2_shard", 2, True, "dense"),
    "ours dp2×tp2 (meta init)": ("dp2_tp2", 4, True, "dense"),
    "ours dp2×tp2×pp2 (meta init)": ("dp2_tp2_pp2", 8, True, "dense"),
    "ours tp2 (eager build)": ("tp2", 2, False, "dense"),
    "ours dp2 shard (eager build)": ("dp2_shard", 2, False, "dense"),
    "Lightning DDPStrategy": ("lightning_ddp", 2, False, "dense"),
    "Lightning ModelParallelStrategy + fully_shard (meta init)": ("lightning_fsdp2", 2, True, "dense"),
    "MoE: ours dp2 ep2 (meta init)": ("dp2_ep2", 2, True, "moe"),
    "MoE: ours dp4 ep2 (meta init)": ("dp4_ep2", 4, True, "moe"),
    "MoE: ours dp2 ep2×pp2 (meta init)": ("dp2_ep2_pp2", 4, True, "moe"),
    "MoE: Lightning DDPStrategy": ("lightning_ddp", 2, False, "moe"),
}
#: The models. Setup has costs that do not grow with the model (the process group, a pipeline's traced graphs,
#: the host buffer one layer is initialised in: ~100 MB together here): models of this size show what grows.
MODELS: dict[str, dict[str, Any]] = {
    # The recipe GPT, 12 blocks of width 1536 (340M parameters, 1.3 GB in float32).
    "dense": {"vocab_size": 128, "block_size": 16, "n_layer": 12, "n_head": 12, "n_embd": 1536, "dropout": 0.0},
    # The recipe GPT with 8 experts (top-2) in each of 8 blocks of width 768 (321M parameters, 94% of them experts).
    "moe": {"vocab_size": 128, "block_size": 16, "n_layer": 8, "n_head": 12, "n_embd": 768, "dropout": 0.0, "n_experts": 8},
}
MODEL = MODELS["dense"]
#: Strategies whose stages are cut (and allocated) on the first batch: setup ends there.
PIPELINED = ("pp2", "dp2_tp2_pp2", "dp2_ep2_pp2")


class SetupMeasured(Exception):
    """Raised on every rank of a pipeline once its stages are built: the measurement is done, no step needed."""


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_setup(strategy_name: str, devices: int, empty_init: bool, model: dict[str, Any], out: Path) -> None:
    """Build and set up one variant in this process (Lightning starts the other ranks); each rank writes
    ``out.<rank>.json`` with the peak bytes it added between building the model and training."""
    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    import lightning_parallel as lp
    from lightning_parallel.strategies.components import pipeline as pipeline_component
    from recipes.data.chars import CharCorpusDataModule
    from recipes.models.gpt import GPTLightningModule

    torch.set_num_threads(1)

    class ShardedByHand(GPTLightningModule):
        """What a user of Lightning's ModelParallelStrategy writes for FSDP2: fully_shard in configure_model."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    strategies = {
        "tp2": lambda: lp.TensorParallelStrategy(data_parallel_mode="replicate"),
        "pp2": lambda: lp.PipelineParallelStrategy(microbatches=2),
        "dp2_shard": lambda: lp.DataParallelStrategy(data_parallel_mode="shard"),
        "dp2_tp2": lambda: lp.HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, data_parallel_mode="shard"),
        "dp2_tp2_pp2": lambda: lp.HybridParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, microbatches=2
        ),
        "dp2_ep2": lambda: lp.HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=2),
        "dp4_ep2": lambda: lp.HybridParallelStrategy(data_parallel_size=4, expert_parallel_size=2),
        "dp2_ep2_pp2": lambda: lp.HybridParallelStrategy(
            data_parallel_size=2, expert_parallel_size=2, pipeline_parallel_size=2, microbatches=2
        ),
        "lightning_ddp": lambda: DDPStrategy(),
        "lightning_fsdp2": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    }
    record: dict[str, int] = {}

    def take_peak() -> None:
        if "peak" not in record:
            record["peak"] = _status_kb("VmHWM") * 1024

    class PeakAtTrainStart(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if strategy_name not in PIPELINED:
                take_peak()
                trainer.should_stop = True  # measured: no training step needed

    built = pipeline_component.PipelineComponent._on_built

    def on_built(self: Any, local: Any) -> None:
        built(self, local)
        take_peak()  # stages cut, allocated and initialised: setup is over for a pipeline
        raise SetupMeasured

    pipeline_component.PipelineComponent._on_built = on_built
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategies[strategy_name](), precision="32-true", max_steps=1,
        num_sanity_val_steps=0, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[PeakAtTrainStart()],
    )
    module_class = ShardedByHand if strategy_name == "lightning_fsdp2" else GPTLightningModule
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    baseline = _status_kb("VmRSS") * 1024
    with trainer.init_module(empty_init=True) if empty_init else nullcontext():
        module = module_class(**model, lr=1e-3)
    with torch.device("meta"):  # the whole model's size, without memory
        whole = sum(p.numel() * p.element_size() for p in GPTLightningModule(**model, lr=1e-3).parameters())
    data = CharCorpusDataModule(block_size=model["block_size"], batch_size=4, max_chars=4000, shuffle=False)
    try:
        trainer.fit(module, datamodule=data)
    except SetupMeasured:
        pass
    result = {"rank": trainer.global_rank, "added_bytes": record.get("peak", 0) - baseline, "whole_model_bytes": whole}
    Path(f"{out}.{trainer.global_rank}.json").write_text(json.dumps(result))


def run_variant(strategy_name: str, devices: int, empty_init: bool, model: dict[str, Any], out: Path, timeout: float = 600) -> dict[str, Any]:
    """Run one variant in fresh processes; the largest fraction any rank added, and every rank's."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", strategy_name, str(devices), str(int(empty_init)),
               json.dumps(model), str(out)]
    proc = subprocess.run(command, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{strategy_name} failed:\n{proc.stderr[-4000:]}")
    ranks = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(devices)]
    whole = ranks[0]["whole_model_bytes"]
    fractions = [r["added_bytes"] / whole for r in sorted(ranks, key=lambda r: r["rank"])]
    return {"max_fraction": max(fractions), "fractions": fractions, "whole_model_bytes": whole}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=5, metavar=("STRATEGY", "DEVICES", "EMPTY_INIT", "MODEL", "OUT"))
    parser.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    args = parser.parse_args()
    if args.worker:
        name, devices, empty_init, model, out = args.worker
        measure_setup(name, int(devices), bool(int(empty_init)), json.loads(model), Path(out))
        return
    saved = RESULTS / "setup_memory.json"
    # --only re-measures some variants and keeps the others' committed figures.
    results: dict[str, Any] = json.loads(saved.read_text())["results"] if args.only and saved.exists() else {}
    with scratch_dir() as scratch:
        for label, (name, devices, empty_init, model) in VARIANTS.items():
            if args.only and label not in args.only:
                continue
            try:
                results[label] = run_variant(name, devices, empty_init, MODELS[model], scratch / name.replace(" ", "_"))
            except RuntimeError as error:
                results[label] = {"error": str(error).strip().splitlines()[-1][:300]}
            print(label, results[label])
    results = {label: results[label] for label in VARIANTS if label in results}
    wholes = {model: next((r["whole_model_bytes"] for label, r in results.items() if VARIANTS[label][3] == model and
                           "whole_model_bytes" in r), 0) for model in MODELS}
    dense, moe = MODELS["dense"], MODELS["moe"]
    setup = (
        f"recipe GPT {dense['n_layer']}×{dense['n_embd']} ({wholes['dense'] / 2**20:.0f} MiB of float32 parameters); "
        f"MoE rows: the recipe GPT with {moe['n_experts']} experts in each of {moe['n_layer']} blocks of width "
        f"{moe['n_embd']} ({wholes['moe'] / 2**20:.0f} MiB); CPU, gloo, 1 thread per rank"
    )
    lines = [
        "# Peak memory added per rank during setup",
        "",
        f"`python benchmarks/setup_memory.py` — {setup}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores.",
        "",
        "Peak resident memory a rank adds from building the model until training starts (pipelines: until its",
        "stages are built and initialised), as a fraction of the whole model's parameters. Goal for tp2, pp2 and",
        "dp2 shard: ≤ 0.6. Under expert parallelism the experts are divided on the meta device (pipelines: after the",
        "cut) and each rank allocates its own only: under dp2 ep2 a rank holds the dense 0.06 and half the experts",
        "(0.47), plus the fixed costs above and the host buffer one MoE layer's experts are initialised in (0.06).",
        "",
        "| variant | ranks | largest rank | every rank |",
        "|---|---|---|---|",
    ]
    for label, result in results.items():
        devices = VARIANTS[label][1]
        if "error" in result:
            lines.append(f"| {label} | {devices} | failed: {result['error']} | |")
        else:
            every = ", ".join(f"{f:.2f}" for f in result["fractions"])
            lines.append(f"| {label} | {devices} | **{result['max_fraction']:.2f}** | {every} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "setup_memory.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "setup_memory.json").write_text(json.dumps({"setup": setup, "results": results}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
