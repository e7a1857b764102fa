"""Synchronous vs less synchronous data parallelism with a straggler and with a slow link.

    python benchmarks/sync_stragglers.py      # ~10 min on 2 cores; writes benchmarks/results/sync_stragglers.{md,json,png}
    python benchmarks/sync_stragglers.py --smoke --results /tmp/smoke   # every method once, 6 steps: seconds

The recipe GPT (2 blocks × 64 wide) trains on 2 CPU ranks with ``DataParallelStrategy(sync=...)``:
``every_step`` (DDP), ``local_sgd`` with H = 4 and 16, ``diloco`` with H = 16, in three settings: as is;
with rank 1 a straggler (it sleeps ``STRAGGLER_S`` per step); with a slow link (every all-reduce waits
``LINK_DELAY_S`` first — a patch of ``torch.distributed.all_reduce`` in the workers, which DDP's hook and
parameter averaging both call). Reported: wall time to reach a training loss of ``TARGET_LOSS`` (rank 0's
loss, averaged over 10 steps), steps taken, and a plot of loss against wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks.*` importable

from benchmarks.common import RESULTS, run_worker_copies, scratch_dir

STEPS = 300
TARGET_LOSS = 2.4
STRAGGLER_S = 0.1
LINK_DELAY_S = 0.2
METHODS = {
    "every_step": {},
    "local_sgd H=4": {"sync": "local_sgd", "sync_every": 4},
    "local_sgd H=16": {"sync": "local_sgd", "sync_every": 16},
    "diloco H=16": {"sync": "diloco", "sync_every": 16},
}
SETTINGS = ("as is", "straggler", "slow link")
#: ``--smoke``: (setting, method) runs (every method, every setting), steps each, and the delays, shortened.
SMOKE_RUNS = [("as is", method) for method in METHODS] + [("straggler", "local_sgd H=4"), ("slow link", "diloco H=16")]
SMOKE_STEPS, SMOKE_DELAY_S = 6, 0.01


def worker(method: str, setting: str, out: Path, steps: int = STEPS, delay_s: float | None = None) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    import lightning_parallel
    from recipes.data.chars import CharCorpusDataModule
    from recipes.models.gpt import GPTLightningModule

    straggler_s, link_delay_s = (STRAGGLER_S, LINK_DELAY_S) if delay_s is None else (delay_s, delay_s)
    all_reduce = dist.all_reduce
    if setting == "slow link":

        def slow_all_reduce(*args, **kwargs):
            time.sleep(link_delay_s)
            return all_reduce(*args, **kwargs)

        dist.all_reduce = slow_all_reduce

    class Timeline(L.Callback):
        def __init__(self) -> None:
            self.points: list[tuple[float, float]] = []
            self.start = 0.0

        def on_train_start(self, trainer, pl_module):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if setting == "straggler" and trainer.global_rank == 1:
                time.sleep(straggler_s)
            self.points.append((time.perf_counter() - self.start, float(outputs["loss"])))

        def on_train_end(self, trainer, pl_module):
            if trainer.is_global_zero:
                out.write_text(json.dumps({"method": method, "setting": setting, "points": self.points}))

    L.seed_everything(0)
    torch.set_num_threads(1)
    model = GPTLightningModule(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64, lr=3e-3)
    data = CharCorpusDataModule(block_size=64, batch_size=16, max_chars=400_000)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=lightning_parallel.DataParallelStrategy(**METHODS[method]),
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Timeline()], num_sanity_val_steps=0, limit_val_batches=0,
    )
    try:
        trainer.fit(model, datamodule=data)
    finally:
        dist.all_reduce = all_reduce  # a process that runs more than this run (the smoke pool) gets it back


def time_to_target(points: list[list[float]], window: int = 10) -> tuple[float | None, int | None]:
    losses = [loss for _, loss in points]
    for index in range(window, len(points) + 1):
        if sum(losses[index - window : index]) / window <= TARGET_LOSS:
            return points[index - 1][0], index
    return None, None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help=f"every method and setting once, {SMOKE_STEPS} steps (use with --results)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for sync_stragglers.{md,json,png}")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "SETTING"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.out, *((SMOKE_STEPS, SMOKE_DELAY_S) if args.smoke else ()))
        return
    from lightning_parallel.observe.plots import render_lines

    results, runs = args.results, []
    steps, straggler_s, link_delay_s = (SMOKE_STEPS, SMOKE_DELAY_S, SMOKE_DELAY_S) if args.smoke else (STEPS, STRAGGLER_S, LINK_DELAY_S)
    plan = SMOKE_RUNS if args.smoke else [(setting, method) for setting in SETTINGS for method in METHODS]
    with scratch_dir(results) as scratch:
        for setting, method in plan:
            worker_args = ["--worker", method, setting, *(["--smoke"] if args.smoke else [])]
            (run,) = run_worker_copies(Path(__file__), worker_args, [scratch / f"{len(runs)}.json"])
            run["seconds_to_target"], run["steps_to_target"] = time_to_target(run["points"])
            runs.append(run)
            print(f"{setting:10s} {method:16s} target after {run['seconds_to_target']} s ({run['steps_to_target']} steps)", flush=True)
    (results / "sync_stragglers.json").write_text(json.dumps(runs))
    lines = [
        "# Synchronous vs local SGD vs DiLoCo with a straggler and a slow link (2 CPU ranks)",
        "",
        (
            f"`python benchmarks/sync_stragglers.py{' --smoke' if args.smoke else ''}` · recipe GPT 2×64, AdamW lr 3e-3, "
            f"16×64 tokens per replica, {steps} steps · straggler: rank 1 sleeps {straggler_s} s per step · slow link: "
            f"{link_delay_s} s before every all-reduce · "
            f"target: rank 0's training loss ≤ {TARGET_LOSS} (mean of 10 steps)"
        ),
        "",
        "| setting | " + " | ".join(METHODS) + " |",
        "|---|" + "---|" * len(METHODS),
    ]
    for setting in SETTINGS:
        cells = []
        for method in METHODS:
            run = next((r for r in runs if r["setting"] == setting and r["method"] == method), None)
            if run is None:  # a smoke run leaves some out
                cells.append("–")
                continue
            seconds, steps = run["seconds_to_target"], run["steps_to_target"]
            cells.append(f"{seconds:.1f} s ({steps} steps)" if seconds is not None else "not reached")
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    lines += ["", "![loss vs wall time](sync_stragglers.png)"]
    (results / "sync_stragglers.md").write_text("\n".join(lines) + "\n")
    render_lines({f"{r['setting']} · {r['method']}": r["points"] for r in runs}, results / "sync_stragglers.png",
                 "wall time (s)", "training loss (rank 0)", "loss vs wall time")
    print((results / "sync_stragglers.md").read_text())


if __name__ == "__main__":
    main()
