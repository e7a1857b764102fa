"""``python -m tests.coverage.world PLAN.json`` under torchrun: one world of ranks runs every planned cell.

Starting processes is the slow part of a tiny job on 2 cores, so one world loops over all families and
layouts. A cell that fails must not end the world: each rank catches its failure, the ranks tell each other
how the cell went through torchrun's store (not a collective: after a failure the process group may hold a
half-finished one), rank 0 records the verdict, and after any failure every rank destroys the process group
(and with it every stage and sub-group) and joins a fresh one under a new store prefix. A hang is bounded by
the strategy's ``timeout`` (a collective that waits longer raises); a rank that dies or hangs outside a
collective is the parent's watchdog's business (:mod:`tests.coverage.sweep`).

The plan: ``{"cells": [{"task", "model_type", "layout", "reference"}], "out": JSONL path, "progress": path}``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.coverage.cells import TIMEOUT, build, describe_failure, judge, train
from tests.coverage.provenance import fingerprint

WAIT = timedelta(seconds=10 * TIMEOUT)  # a rank stuck in a timed-out collective still reports within this


class World:
    """The ranks' shared state: torchrun's store and the current process-group generation."""

    def __init__(self) -> None:
        self.rank, self.size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.size, is_master=False, timeout=WAIT
        )
        self.generation = 0
        self.join()

    def join(self) -> None:
        # Our own prefix per generation: a re-initialised group must not read the previous one's addresses.
        store = dist.PrefixStore(f"/coverage/pg{self.generation}", self.store)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.size, timeout=timedelta(seconds=TIMEOUT))

    def renew(self) -> None:
        """Leave a process group that saw a failure (and every group made from it) and join a fresh one."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.generation += 1
        self.join()

    def exchange(self, index: int, summary: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's summary of cell ``index`` (waits for the others)."""
        keys = [f"/coverage/cell{index}/rank{r}" for r in range(self.size)]
        self.store.set(keys[self.rank], json.dumps(summary))
        self.store.wait(keys, WAIT)
        return [json.loads(self.store.get(key)) for key in keys]

    def serve(self, plan: dict[str, Any], run: Callable[[dict[str, Any]], tuple[dict[str, Any], Any]],
              record: Callable[[dict[str, Any], list[dict[str, Any]], Any, float], dict[str, Any]], label: str,
              name_key: str) -> None:
        """Run every cell of ``plan`` here; rank 0 appends each one's record to ``plan["out"]`` (JSON lines).

        ``run(cell)`` is this rank's side: a JSON summary with ``ok`` that every rank sees, and what stays on this
        rank for ``record(cell, outcomes, kept, started)``, which builds rank 0's record (with ``status`` and
        ``seconds``). After a cell in which any rank failed, every rank joins a fresh process group. Ends the world.
        """
        out, progress = Path(plan["out"]), Path(plan["progress"])
        for index, cell in enumerate(plan["cells"]):
            started = time.time()
            if self.rank == 0:
                progress.write_text(json.dumps({"index": index, "started": started}))
            summary, kept = run(cell)
            outcomes = self.exchange(index, summary)
            if self.rank == 0:
                entry = record(cell, outcomes, kept, started)
                with out.open("a") as f:
                    f.write(json.dumps(entry) + "\n")
                print(f"[{label}] {cell[name_key]} {cell['layout']}: {entry['status']} ({entry['seconds']}s)", flush=True)
            del kept  # the cell's model and trainer go before the next cell builds its own
            gc.collect()
            if any(not o["ok"] for o in outcomes):
                self.renew()
        if self.rank == 0:
            progress.write_text(json.dumps({"index": len(plan["cells"]), "started": time.time()}))
        dist.barrier()
        dist.destroy_process_group()


def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
    """This rank's side of one cell: its findings, or its failure (with when it happened)."""
    start = time.perf_counter()
    recorder = None
    try:
        unused = bool(torch.load(cell["reference"], weights_only=False).get("unused_parameters"))
        model, data, trainer, recorder = build(cell["task"], cell["model_type"], cell["layout"], unused_parameters=unused)
        result = train(model, data, trainer, recorder)
        return {"ok": True, "result": result, "seconds": time.perf_counter() - start}
    except Exception as error:  # noqa: BLE001 - every failure is a finding
        steps = len(recorder.states) if recorder is not None else 0
        return {"ok": False, "failure": describe_failure(error, steps), "at": time.time(), "seconds": time.perf_counter() - start}


def verdict(cell: dict[str, Any], outcomes: list[dict[str, Any]], result: dict[str, Any] | None) -> dict[str, Any]:
    seconds = round(max(o["seconds"] for o in outcomes), 2)
    failures = [o for o in outcomes if not o["ok"]]
    if failures:
        # The first rank to fail tells the cause; the others' errors are usually their collectives timing out.
        return {**min(failures, key=lambda o: o["at"])["failure"], "seconds": seconds}
    expected = torch.load(cell["reference"], weights_only=False)
    largest = max(o["local_bytes"] for o in outcomes)
    return {**judge(cell["layout"], expected, result, largest), "seconds": seconds}


def main(plan_file: str) -> None:
    def run(cell: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        outcome = run_cell(cell)
        result = outcome.pop("result", None)
        return {**outcome, "local_bytes": result["local_bytes"] if result else 0}, result

    def record(cell: dict[str, Any], outcomes: list[dict[str, Any]], result: dict[str, Any] | None, started: float) -> dict[str, Any]:
        return {"task": cell["task"], "model_type": cell["model_type"], "layout": cell["layout"],
                **verdict(cell, outcomes, result), "wall_seconds": round(time.time() - started, 2),
                **fingerprint()}  # what this rank imported: the cell's own record of the library it ran

    World().serve(json.loads(Path(plan_file).read_text()), run, record, label="coverage", name_key="model_type")


if __name__ == "__main__":
    main(sys.argv[1])
