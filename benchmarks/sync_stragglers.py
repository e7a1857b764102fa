"""Synchronous vs less synchronous data parallelism with a straggler and with a slow link.

    python benchmarks/sync_stragglers.py      # ~10 min on 2 cores; writes benchmarks/results/sync_stragglers.{md,json,png}

The recipe GPT (2 blocks × 64 wide) trains on 2 CPU ranks with ``DataParallelStrategy(sync=...)``:
``every_step`` (DDP), ``local_sgd`` with H = 4 and 16, ``diloco`` with H = 16, in three settings: as is;
with rank 1 a straggler (it sleeps ``STRAGGLER_S`` per step); with a slow link (every all-reduce waits
``LINK_DELAY_S`` first — a patch of ``torch.distributed.all_reduce`` in the workers, which DDP's hook and
parameter averaging both call). Reported: wall time to reach a training loss of ``TARGET_LOSS`` (rank 0's
loss, averaged over 10 steps), steps taken, and a plot of loss against wall time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks.*` importable

from benchmarks.common import REPO_ROOT, RESULTS, scratch_dir

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


def worker(method: str, setting: str, out: Path) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist

    import lightning_parallel
    from recipes.data.chars import CharCorpusDataModule
    from recipes.models.gpt import GPTLightningModule

    if setting == "slow link":
        all_reduce = dist.all_reduce

        def slow_all_reduce(*args, **kwargs):
            time.sleep(LINK_DELAY_S)
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
                time.sleep(STRAGGLER_S)
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
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Timeline()], num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(model, datamodule=data)


def time_to_target(points: list[list[float]], window: int = 10) -> tuple[float | None, int | None]:
    losses = [loss for _, loss in points]
    for index in range(window, len(points) + 1):
        if sum(losses[index - window : index]) / window <= TARGET_LOSS:
            return points[index - 1][0], index
    return None, None


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
        return
    from lightning_parallel.observe.plots import render_lines

    runs = []
    with scratch_dir() as scratch:
        for setting in SETTINGS:
            for method in METHODS:
                out = scratch / f"{len(runs)}.json"
                env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")}
                env["OMP_NUM_THREADS"] = "1"
                subprocess.run([sys.executable, __file__, "--worker", method, setting, str(out)], cwd=REPO_ROOT, env=env,
                               check=True, capture_output=True, text=True)
                run = json.loads(out.read_text())
                run["seconds_to_target"], run["steps_to_target"] = time_to_target(run["points"])
                runs.append(run)
                print(f"{setting:10s} {method:16s} target after {run['seconds_to_target']} s ({run['steps_to_target']} steps)", flush=True)
    (RESULTS / "sync_stragglers.json").write_text(json.dumps(runs))
    lines = [
        "# Synchronous vs local SGD vs DiLoCo with a straggler and a slow link (2 CPU ranks)",
        "",
        (
            f"`python benchmarks/sync_stragglers.py` · recipe GPT 2×64, AdamW lr 3e-3, 16×64 tokens per replica, {STEPS} steps · "
            f"straggler: rank 1 sleeps {STRAGGLER_S} s per step · slow link: {LINK_DELAY_S} s before every all-reduce · "
            f"target: rank 0's training loss ≤ {TARGET_LOSS} (mean of 10 steps)"
        ),
        "",
        "| setting | " + " | ".join(METHODS) + " |",
        "|---|" + "---|" * len(METHODS),
    ]
    for setting in SETTINGS:
        cells = []
        for method in METHODS:
            run = next(r for r in runs if r["setting"] == setting and r["method"] == method)
            seconds, steps = run["seconds_to_target"], run["steps_to_target"]
            cells.append(f"{seconds:.1f} s ({steps} steps)" if seconds is not None else "not reached")
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    lines += ["", "![loss vs wall time](sync_stragglers.png)"]
    (RESULTS / "sync_stragglers.md").write_text("\n".join(lines) + "\n")
    render_lines({f"{r['setting']} · {r['method']}": r["points"] for r in runs}, RESULTS / "sync_stragglers.png",
                 "wall time (s)", "training loss (rank 0)", "loss vs wall time")
    print((RESULTS / "sync_stragglers.md").read_text())


if __name__ == "__main__":
    main()
