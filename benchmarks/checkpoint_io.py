"""Checkpoint save and load on a ~50M-parameter GPT: sharded vs full, sync vs background, against Lightning's own.

    python benchmarks/checkpoint_io.py      # ~5 min on 2 cores; writes benchmarks/results/checkpoint_io.{md,json}

The recipe GPT scaled up (8 blocks × 704 wide, 48M parameters, float32, AdamW: a checkpoint holds the
weights and both Adam moments, ~550 MiB) trains two steps, then saves (``trainer.save_checkpoint``, as
``ModelCheckpoint`` does) and restores (what ``Trainer.fit(ckpt_path=...)`` runs: the strategy's
``load_checkpoint``, model and optimizer state). Measured on the slowest rank, median of ``--repeats``:

- blocked: how long training waits in ``save_checkpoint``; with ``async_save=True`` only the copy to host
  memory, the files being written by a background thread;
- complete: until the checkpoint is on disk under its final name (blocked + the background write when it
  is waited for at once; in a run it overlaps the next steps);
- load: restoring model and optimizer state from it; bytes on disk.

Lightning's single device and DDPStrategy (one file written by rank 0, ``TorchCheckpointIO``) run in the
same script. Every process gets one thread; the disk is this VM's (page cache included).
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

from benchmarks.common import RESULTS, run_worker_copies, scratch_dir

MODEL = {"vocab_size": 128, "block_size": 32, "n_layer": 8, "n_head": 8, "n_embd": 704}
#: ``--smoke``: two blocks 32 wide, one save and load each of a few variants (both formats, async, three layouts).
SMOKE_MODEL = {**MODEL, "n_layer": 2, "n_embd": 32}
SMOKE_VARIANTS = ("single, full (Lightning)", "dp=2 DDPStrategy, full (Lightning)", "dp=2 shard, full",
                  "dp=2 shard, sharded, async", "tp=2, sharded")
GLOBAL_BATCH = 8
#: name -> (processes, HybridParallelStrategy arguments, or a Lightning strategy name)
VARIANTS: dict[str, tuple[int, dict | str]] = {
    "single, full (Lightning)": (1, "auto"),
    "dp=2 DDPStrategy, full (Lightning)": (2, "ddp"),
    "dp=2 replicate, full": (2, {"data_parallel_size": 2, "save_format": "full"}),
    "dp=2 replicate, full, async": (2, {"data_parallel_size": 2, "save_format": "full", "async_save": True}),
    "dp=2 replicate, sharded": (2, {"data_parallel_size": 2}),
    "dp=2 replicate, sharded, async": (2, {"data_parallel_size": 2, "async_save": True}),
    "dp=2 shard, full": (2, {"data_parallel_size": 2, "data_parallel_mode": "shard", "save_format": "full"}),
    "dp=2 shard, sharded": (2, {"data_parallel_size": 2, "data_parallel_mode": "shard"}),
    "dp=2 shard, sharded, async": (2, {"data_parallel_size": 2, "data_parallel_mode": "shard", "async_save": True}),
    "tp=2, sharded": (2, {"data_parallel_size": 1, "tensor_parallel_size": 2}),
    "pp=2, sharded": (2, {"data_parallel_size": 1, "pipeline_parallel_size": 2, "microbatches": 4}),
}


def _disk_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def worker(name: str, repeats: int, directory: Path, out: Path, smoke: bool = False) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    from lightning_parallel import HybridParallelStrategy
    from recipes.data.chars import CharCorpusDataModule
    from recipes.models.gpt import GPTLightningModule

    torch.set_num_threads(1)
    L.seed_everything(0)
    devices, spec = VARIANTS[name]
    strategy = spec if isinstance(spec, str) else HybridParallelStrategy(**spec)
    dp = spec.get("data_parallel_size", 1) if isinstance(spec, dict) else devices

    def barrier() -> None:
        if dist.is_initialized():
            dist.barrier()

    class SaveAndLoad(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != 2:
                return
            strategy = trainer.strategy
            timings = []
            for attempt in range(repeats):
                path = directory / f"attempt{attempt}.ckpt"
                barrier()
                start = time.perf_counter()
                trainer.save_checkpoint(path)
                blocked = time.perf_counter() - start
                if hasattr(strategy, "finish_pending_save"):
                    strategy.finish_pending_save()
                barrier()
                complete = time.perf_counter() - start
                size = _disk_bytes(path)
                start = time.perf_counter()
                checkpoint = strategy.load_checkpoint(path)
                strategy.load_model_state_dict(checkpoint)
                strategy.load_optimizer_state_dict(checkpoint)
                barrier()
                load = time.perf_counter() - start
                timings.append({"blocked_s": blocked, "complete_s": complete, "load_s": load, "bytes": size})
            mine = {key: statistics.median(t[key] for t in timings) for key in timings[0]}
            per_rank = [mine]
            if dist.is_initialized():
                per_rank = [None] * dist.get_world_size()
                dist.all_gather_object(per_rank, mine)
            if trainer.is_global_zero:
                out.write_text(json.dumps({"variant": name, "world_size": trainer.world_size, "per_rank": per_rank}))

    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[SaveAndLoad()],
    )
    data = CharCorpusDataModule(block_size=MODEL["block_size"], batch_size=GLOBAL_BATCH // dp, max_chars=20_000 if smoke else 400_000)
    trainer.fit(GPTLightningModule(**(SMOKE_MODEL if smoke else MODEL)), datamodule=data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads per variant (median)")
    parser.add_argument("--smoke", action="store_true", help="a 2×32 GPT, 5 variants, 1 save and load each (use with --results)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for checkpoint_io.{md,json}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--directory", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.repeats, args.directory, args.out, args.smoke)
        return
    if args.smoke:
        args.repeats = 1
    results = args.results

    rows = []
    with scratch_dir(results) as scratch:
        for index, name in enumerate(SMOKE_VARIANTS if args.smoke else VARIANTS):
            directory = scratch / f"variant{index}"
            directory.mkdir()
            worker_args = ["--worker", name, "--repeats", str(args.repeats), "--directory", str(directory)]
            worker_args += ["--smoke"] if args.smoke else []
            (result,) = run_worker_copies(Path(__file__), worker_args, [scratch / f"{index}.json"], ranks=VARIANTS[name][0])
            per_rank = result["per_rank"]
            row = {
                "variant": name,
                "processes": result["world_size"],
                **{key: max(r[key] for r in per_rank) for key in ("blocked_s", "complete_s", "load_s")},
                "bytes": per_rank[0]["bytes"],
            }
            rows.append(row)
            print(f"{name:40s} blocked {row['blocked_s']:.2f} s, complete {row['complete_s']:.2f} s, "
                  f"load {row['load_s']:.2f} s, {row['bytes'] / 2**20:.0f} MiB", flush=True)
    single = rows[0]
    for row in rows:
        row["blocked_vs_single"] = row["blocked_s"] / single["blocked_s"]
        row["load_vs_single"] = row["load_s"] / single["load_s"]
    summary = {
        "command": f"python benchmarks/checkpoint_io.py --repeats {args.repeats}",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "model": SMOKE_MODEL if args.smoke else MODEL,
        "runs": rows,
    }
    (results / "checkpoint_io.json").write_text(json.dumps(summary, indent=2) + "\n")
    mib = 2**20
    lines = [
        "# Checkpoint save and load: sharded vs full, sync vs background (recipe GPT, 48M parameters)",
        "",
        f"Command: `{summary['command']}` · {summary['machine']}",
        "",
        (
            "Recipe GPT 8 blocks × 704 (48M parameters), float32, AdamW (weights + two moments). Slowest rank, median of "
            f"{args.repeats}. Blocked = time training waits in `save_checkpoint`; complete = until the checkpoint is on "
            "disk under its final name (waited for at once here; in a run the background write overlaps training); "
            "load = `load_checkpoint` + model + optimizer state, as `fit(ckpt_path=...)` restores."
        ),
        "",
        "| variant | processes | blocked (s) | blocked / single | complete (s) | load (s) | load / single | on disk (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['processes']} | {r['blocked_s']:.2f} | {r['blocked_vs_single']:.2f} | "
            f"{r['complete_s']:.2f} | {r['load_s']:.2f} | {r['load_vs_single']:.2f} | {r['bytes'] / mib:.0f} |"
        )
    lines += ["", READING, ""]
    (results / "checkpoint_io.md").write_text("\n".join(lines))
    print("\n".join(lines))


READING = (
    "Reading the numbers: a checkpoint holds the same ~550 MiB under every layout (weights and both Adam moments "
    "in float32). Sharded saves need no gather and every rank writes its part at once: training waits 0.61–0.70 "
    "of Lightning's single-device save, while the full format under dp=2 shard waits 1.20 (every shard gathered "
    "onto rank 0, then one writer). Lightning's own save serializes into memory before writing the file; ours "
    "streams into the hidden partial file and renames it. With async_save training waits only for the copy to "
    "host memory: 0.27 of single device for replicated state (each rank copies the whole model) and 0.08 when "
    "the state is sharded (each rank copies its half). The background write itself is slower than a synchronous "
    "one here (complete 2.7–3.7 s against 2.1–2.5 s: on 2 cores the writer thread competes with the training "
    "processes, and DCP coordinates over a second gloo group); in a run it overlaps the next steps. Loading takes "
    "1.1–1.6 s against 0.67 s for Lightning's one process: two processes read at once on 2 cores, and ours first "
    "checks names, shapes and the size of every file; Lightning's DDPStrategy needs 1.13 s. A full checkpoint "
    "loaded under dp=2 shard (2.31 s) is read whole by both ranks and then split. Times move ±20% between runs "
    "on this VM (page cache, neighbours)."
)


if __name__ == "__main__":
    main()
