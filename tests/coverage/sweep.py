"""The sweep's driver (the parent process): build each family, train its single-device reference, then run
every layout cell in one torchrun world, and keep the findings in ``results.json``.

The parent watches the world: a cell that runs past :data:`CELL_LIMIT` (a rank died, or hangs outside a
collective, where the strategy's timeout cannot reach) gets the world killed, is recorded as a crash, and a
new world carries on with the next cell.
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
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

from tests.coverage.cells import (
    EXPERT_LAYOUTS,
    LAYOUTS,
    THREADS,
    describe_failure,
    reference,
)
from tests.coverage.configs import NOT_COMPARABLE, mapping
from tests.coverage.provenance import fingerprint, summarise
from tests.harness import launch_environment


def quiet() -> None:
    """Keep the sweep's own lines readable: Lightning's and transformers' per-run notices are not findings."""
    import logging

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_parallel", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _worker_start() -> None:
    """A reference worker: quiet, and one thread (two workers share the two cores, as torchrun's ranks do)."""
    quiet()
    torch.set_num_threads(THREADS)

RESULTS = Path(__file__).with_name("results.json")
REPO_ROOT = Path(__file__).resolve().parents[2]
CELL_LIMIT = 480  # seconds: several collectives may each wait the strategy's 60 s timeout before a cell fails
RANKS = 2


def load(path: Path = RESULTS) -> dict[str, Any]:
    if path.exists():
        return json.loads(path.read_text())
    return {"families": {}}


def save(results: dict[str, Any], path: Path = RESULTS) -> None:
    import transformers

    # A partial re-sweep under newer libraries keeps the older cells: the versions line names every version swept.
    previous = results.get("versions", {})
    results["versions"] = {name: _merged_versions(previous.get(name), now) for name, now in
                           (("transformers", transformers.__version__), ("torch", torch.__version__.split("+")[0]))}
    results["families"] = dict(sorted(results["families"].items(), key=lambda kv: (kv[1]["task"], kv[0])))
    # The commits (and library hashes) the cells were measured at, first in the file: partial re-sweeps mix them.
    ordered = {"swept_at": summarise(results["families"]), **{k: v for k, v in results.items() if k != "swept_at"}}
    path.write_text(json.dumps(ordered, indent=1, sort_keys=False) + "\n")


def _merged_versions(previous: str | None, now: str) -> str:
    """``"5.24.0"`` and ``"5.25.0"`` -> ``"5.24.0 and 5.25.0"``; a version already named is not repeated."""
    seen = previous.split(" and ") if previous else []
    return " and ".join(seen if now in seen else [*seen, now])


def key(task: str, model_type: str) -> str:
    return f"{task}/{model_type}"


def prepare(task: str, model_type: str, workdir: Path) -> dict[str, Any]:
    """Build the family and train its single-device reference; the family's record (``built`` or the reason)."""
    record: dict[str, Any] = {"task": task, "model_type": model_type, "model_class": mapping(task)[model_type]}
    start = time.perf_counter()
    if model_type in NOT_COMPARABLE:
        record.update(built=False, reason=NOT_COMPARABLE[model_type], where="tests/coverage/configs.py NOT_COMPARABLE",
                      reference_seconds=0.0, **fingerprint())
        return record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = reference(task, model_type)
    except Exception as error:  # noqa: BLE001 - the reason is the finding
        failure = describe_failure(error, 0)
        record.update(built=False, reason=f"{failure['error']}: {failure['message']}", where=failure["where"])
    else:
        path = workdir / f"{task}-{model_type}.pt"
        torch.save(expected, path)
        record.update(built=True, model_class=expected["model_class"], reference=str(path), parameters=expected["local_bytes"] // 8,
                      experts=expected["experts"])
    record["reference_seconds"] = round(time.perf_counter() - start, 2)
    record.update(fingerprint())  # a family not built has no cells to say when that was found
    return record


def run_world(cells: list[dict[str, Any]], workdir: Path, log: Any = None) -> list[dict[str, Any]]:
    """Every cell's verdict, from as few torchrun worlds as the failures allow."""
    done: list[dict[str, Any]] = []
    while len(done) < len(cells):
        remaining = cells[len(done):]
        out, progress = workdir / f"cells-{len(done)}.jsonl", workdir / f"progress-{len(done)}.json"
        plan = workdir / f"plan-{len(done)}.json"
        plan.write_text(json.dumps({"cells": remaining, "out": str(out), "progress": str(progress)}))
        reason = _launch(plan, out, progress, workdir / "world.log", log)
        done += [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
        if reason is not None and len(done) < len(cells):
            cell = cells[len(done)]
            done.append({"task": cell["task"], "model_type": cell["model_type"], "layout": cell["layout"],
                         "status": "crash", "error": "WorldFailure", "message": reason, "where": "", "seconds": None,
                         **fingerprint()})
            _say(log, f"{cell['model_type']:>24} {cell['layout']}: crash ({reason})")
    return done


def _launch(plan: Path, out: Path, progress: Path, log_path: Path, log: Any) -> str | None:
    """Run one world on ``plan`` (its verdicts land in ``out``); ``None`` when it finished, else why it ended early."""
    # The ranks' thread count is the references' (THREADS), whatever training in this process left in os.environ.
    env = {**launch_environment(OMP_NUM_THREADS=str(THREADS)), "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
               "-m", "tests.coverage.world", str(plan)]
    shown = 0
    with log_path.open("a") as world_log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=world_log, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            time.sleep(1)
            shown = _show(out, shown, log)
            try:
                started = json.loads(progress.read_text())["started"]
            except (OSError, ValueError, KeyError):  # not written yet, or being written
                continue
            if time.time() - started > CELL_LIMIT:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                _show(out, shown, log)
                return f"the cell ran past {CELL_LIMIT}s (a rank hung outside a collective); world killed"
    _show(out, shown, log)
    return None if proc.returncode == 0 else f"the world exited with code {proc.returncode} (a rank died; see the log)"


def _show(out: Path, shown: int, log: Any) -> int:
    """Print the verdicts the world wrote since the last look; how many lines are shown now."""
    lines = out.read_text().splitlines() if out.exists() else []
    for line in lines[shown:]:
        record = json.loads(line)
        _say(log, f"{record['model_type']:>24} {record['layout']}: {record['status']} ({record['seconds']}s)")
    return len(lines)


def prepare_all(families: list[tuple[str, str]], workdir: Path, log: Any) -> dict[str, dict[str, Any]]:
    """:func:`prepare` for every family, two at a time (a spawned pool: the references run on both cores)."""
    records: dict[str, dict[str, Any]] = {}
    pending, solo = list(families), False
    while pending:
        # After a worker died, the next family runs alone: if its worker dies too, it is the one that kills.
        batch = pending[:1] if solo else list(pending)
        with ProcessPoolExecutor(1 if solo else RANKS, mp_context=get_context("spawn"), initializer=_worker_start) as pool:
            futures = [(family, pool.submit(prepare, *family, workdir)) for family in batch]
            broken = False
            for family, future in futures:
                try:
                    record = future.result()
                except BrokenProcessPool:
                    broken = True
                    break
                pending.remove(family)
                records[key(*family)] = record
                _say(log, f"{key(*family)}: {'built' if record['built'] else 'not built: ' + record['reason']} ({record['reference_seconds']}s)")
        if broken and solo:
            task, model_type = pending.pop(0)
            records[key(task, model_type)] = {"task": task, "model_type": model_type, "model_class": mapping(task)[model_type],
                                              "built": False, "reason": "the process building it died", "reference_seconds": 0.0,
                                              **fingerprint()}
            _say(log, f"{key(task, model_type)}: not built: the process building it died")
        solo = broken and not solo
    return {key(*family): records[key(*family)] for family in families}


def _say(log: Any, text: str) -> None:
    if log is not None:
        print(text, file=log, flush=True)


def sweep(
    families: list[tuple[str, str]],
    layouts: list[str],
    results_path: Path = RESULTS,
    resume: bool = False,
    workdir: Path | None = None,
    log: Any = sys.stdout,
) -> dict[str, Any]:
    """Run the sweep over ``families`` × ``layouts`` and merge the findings into ``results_path``."""
    results = load(results_path)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="coverage-"))
    cells: list[dict[str, Any]] = []
    wanted = [family for family in families if not (resume and key(*family) in results["families"])]
    records = prepare_all(wanted, workdir, log)
    for record in records.values():
        if record["built"]:
            # Expert-parallel layouts only where there are routed experts to divide (elsewhere: refused by design).
            cells += [{"task": record["task"], "model_type": record["model_type"], "layout": layout, "reference": record["reference"]}
                      for layout in layouts if layout not in EXPERT_LAYOUTS or record.get("experts", True)]
    for verdict in run_world(cells, workdir, log) if cells else []:
        layout = verdict.pop("layout")
        records[key(verdict.pop("task"), verdict.pop("model_type"))].setdefault("cells", {})[layout] = verdict
    for name, record in records.items():
        record.pop("reference", None)
        old = results["families"].get(name, {})
        if record.get("built") and old.get("built"):  # a run of some layouts keeps the others' cells
            record["cells"] = {**old.get("cells", {}), **record.get("cells", {})}
        record["cells"] = {layout: record.get("cells", {})[layout] for layout in LAYOUTS if layout in record.get("cells", {})}
        results["families"][name] = record
    save(results, results_path)
    return results
