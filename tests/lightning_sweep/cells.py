"""One cell: a case run under one layout (or on one device, ``layout=None``), and its verdict against one device.

``same``: the training (losses, gradients, weights after every step, on rank 0's whole-model view) and every rank's
observations equal one device's (float64: within :data:`TOL`); ``refused``: the library's own error, raised on purpose
before the first step (:func:`tests.coverage.cells.describe_failure`); ``wrong``: it ran and something differs;
``crash``: any other error.
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightning_parallel
from tests.coverage.cells import describe_failure
from tests.harness import Recorder, single_device_order
from tests.lightning_sweep.cases import (
    CASES,
    GLOBAL_BATCH,
    Context,
    SweepData,
    SweepGPT,
)

STEPS = 4
SEED = 1234
TOL = 1e-6
TIMEOUT = 60  # seconds a collective may wait: a hang becomes an error, and the world goes on
SPLIT = ["model.blocks.1"]

#: layout -> (ranks, data-parallel replicas, HybridParallelStrategy options)
LAYOUTS: dict[str, tuple[int, int, dict[str, Any]]] = {
    "dp2": (2, 2, {"data_parallel_size": 2}),
    "dp2 shard": (2, 2, {"data_parallel_size": 2, "data_parallel_mode": "shard"}),
    "tp2": (2, 1, {"data_parallel_size": 1, "tensor_parallel_size": 2}),
    "pp2": (2, 1, {"data_parallel_size": 1, "pipeline_parallel_size": 2, "split_points": SPLIT}),
    "tp2 x pp2": (4, 1, {"data_parallel_size": 1, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "split_points": SPLIT}),
}


def build(case_name: str, layout: str | None, root: Path) -> tuple[SweepGPT, SweepData, L.Trainer, Recorder | None, Context]:
    case = CASES[case_name]
    torch.set_num_threads(1)
    L.seed_everything(SEED, workers=True)
    model = SweepGPT(**case.module)
    replicas = 1 if layout is None else LAYOUTS[layout][1]
    data = SweepData(GLOBAL_BATCH // replicas, case.train_size)
    ctx = Context(root=root)
    ctx.callbacks = case.callbacks(ctx)
    recorder = Recorder() if case.compare_training else None
    if layout is None:
        strategy: Any = "auto"
        single_device_order(data, SEED)  # Lightning's distributed sampler shuffles: one device reads the same order
    else:
        strategy = lightning_parallel.HybridParallelStrategy(timeout=TIMEOUT, **LAYOUTS[layout][2])
    options = {
        "max_steps": STEPS, "limit_val_batches": 2, "num_sanity_val_steps": 0, "val_check_interval": None,
        "check_val_every_n_epoch": None, "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False, "log_every_n_steps": 1, **case.trainer,
    }
    if options["val_check_interval"] is None and "max_epochs" in case.trainer:
        options["check_val_every_n_epoch"] = 1  # epoch-based cases validate at each epoch's end
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if layout is None else LAYOUTS[layout][0], strategy=strategy, precision="64-true",
        callbacks=[*ctx.callbacks, *([recorder] if recorder else [])], logger=ctx.logger, default_root_dir=root, **options,
    )
    return model, data, trainer, recorder, ctx


def run_cell(case_name: str, layout: str | None, root: Path) -> dict[str, Any]:
    """This rank's side of one cell: ``{"ok", "observed", "training" (rank 0), "seconds"}`` or its failure."""
    start = time.perf_counter()
    recorder = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, data, trainer, recorder, ctx = build(case_name, layout, root)
            case = CASES[case_name]
            (case.run or _fit)(trainer, model, data, ctx)
            observed = case.observe(trainer, model, data, ctx)
        training = None
        if recorder is not None:
            training = {k: recorder.result[k] for k in ("step_losses",)} | {"grads": recorder.grads, "states": recorder.states}
        return {"ok": True, "observed": _plain(observed), "training": training, "seconds": time.perf_counter() - start}
    except Exception as error:  # noqa: BLE001 - every failure is a finding
        steps = len(recorder.states) if recorder is not None else 0
        return {"ok": False, "failure": describe_failure(error, steps), "at": time.time(), "seconds": time.perf_counter() - start}


def _fit(trainer: L.Trainer, model: SweepGPT, data: SweepData, ctx: Context) -> None:
    trainer.fit(model, datamodule=data)


def _plain(value: Any) -> Any:
    """JSON-able: tensors become floats or lists."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value


def judge(expected: dict[str, Any], outcomes: list[dict[str, Any]], training: dict[str, Any] | None) -> dict[str, Any]:
    """The cell's verdict from every rank's outcome (``training``: rank 0's, compared when the case compares it)."""
    seconds = round(max(o["seconds"] for o in outcomes), 2)
    failures = [o for o in outcomes if not o["ok"]]
    if failures:
        # The first rank to fail tells the cause; the others' errors are usually their collectives timing out.
        return {**min(failures, key=lambda o: o["at"])["failure"], "seconds": seconds}
    differences: list[str] = []
    if expected.get("training") is not None:
        differences += compare_training(expected["training"], training)
    merged_rows: dict[str, float] = {}
    for rank, outcome in enumerate(outcomes):
        observed = dict(outcome["observed"])
        if "rows" in expected["observed"]:  # each rank's own rows (predictions, a stage's parameters): the union
            for index, value in observed.pop("rows", {}).items():
                if index in merged_rows and abs(merged_rows[index] - value) > TOL:
                    differences.append(f"rank {rank}: row {index} differs from another rank's")
                merged_rows[index] = value
        wanted = {k: v for k, v in expected["observed"].items() if k != "rows"}
        if rank > 0 and "samples_per_batch" in wanted and "samples_per_batch" not in observed:
            wanted.pop("samples_per_batch")  # ThroughputMonitor computes on rank 0 only, as on one device
        differences += [f"rank {rank}: {d}" for d in compare_values(wanted, observed)]
    if "rows" in expected["observed"]:
        differences += [f"rows: {d}" for d in compare_values(expected["observed"]["rows"], merged_rows)]
    if differences:
        return {"status": "wrong", "first_difference": differences[0][:300], "differences": len(differences), "seconds": seconds}
    return {"status": "same", "seconds": seconds}


def compare_values(expected: Any, actual: Any, where: str = "") -> list[str]:
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(expected) != set(actual):
            missing = sorted(set(expected) ^ set(actual if isinstance(actual, dict) else {}))[:4]
            return [f"{where or 'observed'}: keys differ {missing}"]
        return [d for k in expected for d in compare_values(expected[k], actual[k], f"{where}.{k}" if where else k)]
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(expected) != len(actual):
            return [f"{where}: {len(actual) if isinstance(actual, list) else actual!r} values, expected {len(expected)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in compare_values(e, a, f"{where}[{i}]")]
    if isinstance(expected, float) or isinstance(actual, float):
        if not isinstance(actual, (int, float)) or not math.isclose(float(actual), float(expected), rel_tol=TOL, abs_tol=TOL):
            return [f"{where}: {actual!r}, expected {expected!r}"]
        return []
    return [] if expected == actual else [f"{where}: {actual!r}, expected {expected!r}"]


def compare_training(expected: dict[str, Any], actual: dict[str, Any] | None) -> list[str]:
    """Losses, gradients and weights after every step (gradients within 1e-6 of the step's largest)."""
    if actual is None:
        return ["no training recorded"]
    out = []
    losses, wanted = torch.as_tensor(actual["step_losses"]).double(), torch.as_tensor(expected["step_losses"]).double()
    if losses.shape != wanted.shape or (losses - wanted).abs().max() > TOL:
        out.append(f"losses {losses.tolist()} vs {wanted.tolist()}")
    for kind in ("grads", "states"):
        if len(actual[kind]) != len(expected[kind]):
            out.append(f"{kind}: {len(actual[kind])} steps, expected {len(expected[kind])}")
            continue
        for step, (got, want) in enumerate(zip(actual[kind], expected[kind])):
            if got.keys() != want.keys():
                out.append(f"{kind} after step {step + 1}: names differ {sorted(set(want) ^ set(got))[:3]}")
                continue
            scale = max([float(v.abs().max()) for v in want.values() if v.is_floating_point() and v.numel()] or [1.0])
            for name, value in want.items():
                if value.is_floating_point():
                    diff = float((got[name].double() - value.double()).abs().max()) if value.numel() else 0.0
                    if not diff <= TOL * max(1.0, scale if kind == "grads" else 1.0):
                        out.append(f"{kind[:-1]} {name} after step {step + 1}: {diff:.2e}")
    return out
