"""``python -m tests.lightning_sweep.world PLAN.json`` under torchrun: one world of ranks runs every planned cell.

As the coverage sweep's world (:mod:`tests.coverage.world`): a failing cell does not end the world; the ranks tell each
other how it went through torchrun's store, rank 0 writes the verdict, and after a failure every rank joins a fresh
process group. The plan: ``{"cells": [{"case", "layout", "reference"}], "out": JSONL path, "progress": path,
"root": directory}``.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.coverage.world import World
from tests.lightning_sweep.cells import judge, run_cell


def main(plan_file: str) -> None:
    plan = json.loads(Path(plan_file).read_text())
    world = World()
    out, progress, root = Path(plan["out"]), Path(plan["progress"]), Path(plan["root"])
    for index, cell in enumerate(plan["cells"]):
        started = time.time()
        if world.rank == 0:
            progress.write_text(json.dumps({"index": index, "started": started}))
        directory = root / f"{cell['case']}-{cell['layout'].replace(' ', '_')}"
        outcome = run_cell(cell["case"], cell["layout"], directory)
        training = outcome.pop("training", None)
        outcomes = world.exchange(index, outcome)
        if world.rank == 0:
            expected = torch.load(cell["reference"], weights_only=False)
            record = {"case": cell["case"], "layout": cell["layout"], **judge(expected, outcomes, training)}
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[lightning sweep] {cell['case']} {cell['layout']}: {record['status']} ({record['seconds']}s)", flush=True)
        del training, outcome
        gc.collect()
        if any(not o["ok"] for o in outcomes):
            world.renew()
    if world.rank == 0:
        progress.write_text(json.dumps({"index": len(plan["cells"]), "started": time.time()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
