"""The sweep's driver: each case's single-device reference in this process, then every cell of a world size in one
torchrun world (2 ranks: dp2, dp2 shard, tp2, pp2; 4 ranks: tp2 x pp2), the verdicts kept in ``results.json``.

A cell that runs past :data:`CELL_LIMIT` (a rank died, or hangs outside a collective) gets the world killed, is
recorded as a crash, and a new world carries on with the next cell.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from tests.harness import launch_environment
from tests.lightning_sweep.cases import CASES
from tests.lightning_sweep.cells import LAYOUTS, _plain, run_cell

RESULTS = Path(__file__).with_name("results.json")
REPO_ROOT = Path(__file__).resolve().parents[2]
CELL_LIMIT = 300  # seconds: several collectives may each wait the strategy's 60 s timeout before a cell fails


def quiet() -> None:
    import logging

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_parallel"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def reference(case: str, workdir: Path) -> dict[str, Any]:
    """One device's run of ``case``: saved for the worlds; the record (or why it failed)."""
    outcome = run_cell(case, None, workdir / f"{case}-single")
    if not outcome["ok"]:
        return {"built": False, **outcome["failure"]}
    path = workdir / f"{case}.pt"
    torch.save({"observed": outcome["observed"], "training": outcome["training"]}, path)
    return {"built": True, "reference": str(path), "seconds": round(outcome["seconds"], 2)}


def run_worlds(cells: list[dict[str, Any]], ranks: int, workdir: Path, log: Any) -> list[dict[str, Any]]:
    """Every cell's verdict, from as few torchrun worlds of ``ranks`` as the failures allow."""
    done: list[dict[str, Any]] = []
    while len(done) < len(cells):
        remaining = cells[len(done):]
        tag = f"{ranks}-{len(done)}"
        out, progress, plan = workdir / f"cells-{tag}.jsonl", workdir / f"progress-{tag}.json", workdir / f"plan-{tag}.json"
        plan.write_text(json.dumps({"cells": remaining, "out": str(out), "progress": str(progress), "root": str(workdir / "cells")}))
        reason = _launch(plan, ranks, progress, workdir / "world.log")
        got = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        for record in got:
            _say(log, f"{record['case']:>32} {record['layout']}: {record['status']} ({record['seconds']}s)")
        done += got
        if reason is not None and len(done) < len(cells):
            cell = cells[len(done)]
            done.append({"case": cell["case"], "layout": cell["layout"], "status": "crash", "error": "WorldFailure",
                         "message": reason, "where": "", "seconds": None})
            _say(log, f"{cell['case']:>32} {cell['layout']}: crash ({reason})")
    return done


def _launch(plan: Path, ranks: int, progress: Path, log_path: Path) -> str | None:
    env = {**launch_environment(OMP_NUM_THREADS="1"), "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "tests.lightning_sweep.world", str(plan)]
    with log_path.open("a") as world_log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=world_log, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            time.sleep(1)
            try:
                started = json.loads(progress.read_text())["started"]
            except (OSError, ValueError, KeyError):
                continue
            if time.time() - started > CELL_LIMIT:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return f"the cell ran past {CELL_LIMIT}s (a rank hung outside a collective); world killed"
    return None if proc.returncode == 0 else f"the world exited with code {proc.returncode} (a rank died; see the log)"


def _say(log: Any, text: str) -> None:
    if log is not None:
        print(text, file=log, flush=True)


def load(path: Path = RESULTS) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"cases": {}}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def sweep(cases: list[str], layouts: list[str], results_path: Path | None = RESULTS, workdir: Path | None = None,
          log: Any = sys.stdout, only: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Run ``cases`` x ``layouts`` (``only``: just these (case, layout) cells); merged into ``results_path``
    (``None``: not written) and returned."""
    quiet()
    commit = git_commit()  # what runs (a later commit by someone else must not be named)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="lightning-sweep-"))
    results = load(results_path) if results_path is not None else {"cases": {}}
    records: dict[str, dict[str, Any]] = {}
    for case in cases:
        records[case] = reference(case, workdir)
        _say(log, f"{case}: reference {'ran' if records[case]['built'] else 'failed: ' + records[case]['message']}")
    cells = [{"case": case, "layout": layout, "reference": record["reference"]}
             for case, record in records.items() if record["built"] for layout in layouts
             if only is None or (case, layout) in only]
    for ranks in sorted({LAYOUTS[layout][0] for layout in layouts}):
        group = [cell for cell in cells if LAYOUTS[cell["layout"]][0] == ranks]
        for verdict in run_worlds(group, ranks, workdir, log) if group else []:
            records[verdict.pop("case")].setdefault("cells", {})[verdict.pop("layout")] = verdict
    for case, record in records.items():
        record.pop("reference", None)
        record["commit"] = commit
        old = results["cases"].get(case, {}).get("cells", {})
        merged = {**old, **record.get("cells", {})}
        record["cells"] = {layout: merged[layout] for layout in LAYOUTS if layout in merged}
        results["cases"][case] = record
    results["cases"] = {case: results["cases"][case] for case in CASES if case in results["cases"]}
    import lightning

    # The commit most cases were swept at (a partial re-sweep names its own per case, docs/lightning-callbacks.md).
    swept = [record.get("commit", commit) for record in results["cases"].values()]
    results["commit"] = max(set(swept), key=swept.count)
    results["versions"] = {"lightning": lightning.__version__, "torch": torch.__version__.split("+")[0]}
    if results_path is not None:
        results_path.write_text(json.dumps(_plain(results), indent=1) + "\n")
    return results
