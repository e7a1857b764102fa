"""One cell of the sweep: a family trained under one layout, compared with single-device training.

The Trainer is built as :mod:`tests.harness` builds its jobs (float64, SGD, no shuffling, the single-device
run fed the distributed sampler's order) and the same :class:`tests.harness.Recorder` collects losses,
gradients and parameters after every step; validation then runs with batches of another size.
"""

from __future__ import annotations

import ast
import functools
import os
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightning_parallel
from lightning_parallel.parallelize.expert.experts import find_routed_experts
from lightning_parallel.parallelize.data.batchnorm import batch_statistics_layers
from tests.coverage.configs import EAGER_EXPERTS
from tests.coverage.models import CoverageData, CoverageModule, channels_of, image_size_of
from tests.harness import Recorder, single_device_order

STEPS = 3
BATCH = 8  # global rows per training batch (4 micro-batches of 2 under pp2; 4 rows per replica under dp2)
VAL_BATCH = 4  # global rows per validation batch: not the training batch size
TOL = 1e-6
#: A cell is exact within ``min(MAX_TOLERANCE, max(TOL, FLOOR_MARGIN * floor))``, ``floor`` being how far
#: single-device training moves when only the order of its sums changes (the same batches, accumulated as two halves).
#: float64 models' floor is ~1e-13, so TOL decides for them. Models that compute parts in float32 by design (Gemma 4's
#: norms and attention: ``x.float()``) have a floor of ~1e-9, which a few steps of a sensitive tiny model amplify by
#: orders of magnitude, differently for every reordering: Gemma 4 under dp2 differs by 3.7e-6 after 3 steps against
#: a floor of 5.6e-9, and by 7e-12 with its float32 casts removed (exact). A bug (a wrong average, a missing sum)
#: differs by 1e-2 or more, which MAX_TOLERANCE still catches.
FLOOR_MARGIN = 1000.0
MAX_TOLERANCE = 1e-4
SHARE = 0.6  # TP: the largest rank's parameter bytes / the whole model's
TIMEOUT = 60  # seconds a collective may wait: a hang becomes an error, and the world goes on
SEED = 1234
#: Intra-op threads of every run, reference and cell alike. Results may depend on it: MKL's QR, behind
#: ``nn.init.orthogonal_`` (RWKV's embedding and head), rounds a 128x32 float32 matrix differently on 1 and on 2
#: threads (1.2e-7), and RWKV's tiny embedding (gain 1e-4) under a LayerNorm turns that into 5.4e-5 in its gradient.
THREADS = 1

#: layout -> (data-parallel replicas, strategy class name, options)
LAYOUTS: dict[str, tuple[int, str, dict[str, Any]]] = {
    "dp2": (2, "DataParallelStrategy", {}),
    "tp2": (1, "TensorParallelStrategy", {}),
    "pp2": (1, "PipelineParallelStrategy", {"microbatches": 4}),  # more micro-batches than stages
    "cp2": (1, "HybridParallelStrategy", {"context_parallel_size": 2, "data_parallel_size": 1}),
    # Expert parallelism borrows the two data-parallel ranks: each holds half of every MoE layer's experts.
    "ep2": (2, "HybridParallelStrategy", {"data_parallel_size": 2, "expert_parallel_size": 2}),
}
#: Layouts that only mixture-of-experts families can use (a dense model is refused by name: nothing to divide);
#: the committed results sweep them over the families that hold experts.
EXPERT_LAYOUTS = ("ep2",)


def build(task: str, model_type: str, layout: str | None, accumulate: int = 1,
          unused_parameters: bool = False) -> tuple[CoverageModule, CoverageData, L.Trainer, Recorder]:
    """Module, data and Trainer for one cell (``layout=None``: the single-device reference; ``accumulate``: each
    training batch fed as that many accumulated parts, the same rows in the same order; ``unused_parameters``:
    single-device training left some parameters without a gradient)."""
    torch.set_num_threads(THREADS)  # before the model is initialised: see THREADS
    L.seed_everything(SEED, workers=True)
    model = CoverageModule(task, model_type, experts=EAGER_EXPERTS)
    replicas = 1 if layout is None else LAYOUTS[layout][0]
    data = CoverageData(task, BATCH // replicas // accumulate, VAL_BATCH // replicas, channels=channels_of(model),
                        image=image_size_of(model))
    model.cell_settings = settings(model, layout, unused_parameters)
    if layout is None:
        strategy: Any = "auto"
        single_device_order(data, SEED)
    else:
        _, name, options = LAYOUTS[layout]
        extra = {k: v for k, v in model.cell_settings.items() if k in STRATEGY_SETTINGS}
        strategy = getattr(lightning_parallel, name)(timeout=TIMEOUT, **options, **extra)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if layout is None else 2, strategy=strategy, precision="64-true",
        max_steps=STEPS, accumulate_grad_batches=accumulate, limit_val_batches=2, num_sanity_val_steps=0, val_check_interval=None,
        check_val_every_n_epoch=None, callbacks=[recorder], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    return model, data, trainer, recorder


#: Strategies whose layouts reduce gradients through DDP (over data- or context-parallel ranks).
GRADIENT_REDUCING = ("DataParallelStrategy", "HybridParallelStrategy")
#: Settings the strategy takes (the others are the model's).
STRATEGY_SETTINGS = ("sync_batchnorm", "find_unused_parameters")


def settings(model: CoverageModule, layout: str | None, unused_parameters: bool = False) -> dict[str, Any]:
    """What the cell runs beyond its layout's defaults, recorded with its verdict.

    * ``sync_batchnorm=True`` for data parallelism over a model with BatchNorm layers: without it each
      replica normalises by its own slice (as Lightning's DDP does, and the strategy warns); with it DP
      computes what one device does, which is what the README promises and the cell checks.
    * ``find_unused_parameters=True`` for data or context parallelism over a model whose forward leaves parameters without a
      gradient (a vision tower a text-only batch never calls, a decoder's unused cross-attention): without it DDP
      stops at the second step with the strategy's error naming this fix, which is what a user then sets.
    * ``experts_implementation`` for mixture-of-experts models (see :data:`tests.coverage.configs.EAGER_EXPERTS`).
    """
    found: dict[str, Any] = {}
    if layout is not None and LAYOUTS[layout][0] > 1 and batch_statistics_layers(model, training=True):
        found["sync_batchnorm"] = True
    if layout is not None and unused_parameters and LAYOUTS[layout][1] in GRADIENT_REDUCING:
        found["find_unused_parameters"] = True
    implementation = getattr(model.net.config, "_experts_implementation", None)
    if any("experts" in type(m).__name__.lower() for m in model.net.modules()) and implementation is not None:
        found["experts_implementation"] = implementation
    return found


def train(model: CoverageModule, data: CoverageData, trainer: L.Trainer, recorder: Recorder) -> dict[str, Any]:
    """Fit, then validate; rank 0's findings (with ``validation``) and this rank's parameter bytes."""
    trainer.fit(model, datamodule=data)
    result = dict(recorder.result)
    result["validation"] = trainer.validate(model, datamodule=data, verbose=False)[0]
    result["local_bytes"] = _local_bytes(model)
    result["model_class"] = type(model.net).__name__
    result["settings"] = dict(getattr(model, "cell_settings", {}))
    # Running statistics of each replica's slice (I-BERT's activation ranges): the strategy warned, naming them.
    result["divergent_buffers"] = list(getattr(getattr(trainer.strategy, "data_parallel", None), "divergent_buffers", []))
    return result


def _local_bytes(model: torch.nn.Module) -> int:
    from tests.harness import local_shard

    return sum(local_shard(p).numel() * p.element_size() for p in model.parameters())


def reference(task: str, model_type: str) -> dict[str, Any]:
    """Single-device training (what every layout must reproduce), and its noise ``floor``: how far the same training
    moves when each batch is accumulated as two halves (only the order of the sums changes)."""
    built = build(task, model_type, None)
    experts = bool(find_routed_experts(built[0]))  # what the expert-parallel layouts apply to
    result = train(*built)
    keep = ("step_losses", "states", "grads", "validation", "local_bytes", "model_class")
    trained = {name for name, parameter in built[0].named_parameters() if parameter.requires_grad}
    unused = sorted(trained - set(result["grads"][0]))
    expected = {**{k: result[k] for k in keep}, "experts": experts, "unused_parameters": unused}
    reordered = train(*build(task, model_type, None, accumulate=2))
    # Buffers are left out: batch statistics (BatchNorm's, I-BERT's ranges) differ by design between the halves.
    expected["floor"] = compare(expected, reordered, buffers=False)[0]
    return expected


def tolerance(expected: dict[str, Any]) -> float:
    """How far a cell may differ from its reference and still be exact (see :data:`FLOOR_MARGIN`)."""
    return min(MAX_TOLERANCE, max(TOL, FLOOR_MARGIN * expected.get("floor", 0.0)))


def compare(expected: dict[str, Any], actual: dict[str, Any], buffers: bool = True) -> tuple[float, float, str]:
    """(max absolute difference, max relative difference, what differs first) over losses, gradients, parameters
    and (with ``buffers``) buffers, except the buffers the strategy warned differ between replicas
    (``divergent_buffers``)."""
    warned = set(actual.get("divergent_buffers", ()))
    if not buffers:  # everything in the states that is not a trained parameter
        trained = set().union(*(step.keys() for step in expected["grads"]))
        warned |= set().union(*(step.keys() for step in expected["states"])) - trained
    worst_abs, worst_rel, first = 0.0, 0.0, ""

    def see(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
        nonlocal worst_abs, worst_rel, first
        a, b = torch.as_tensor(a).double().cpu(), torch.as_tensor(b).double().cpu()
        if a.shape != b.shape:
            worst_abs = worst_rel = float("inf")
            first = first or f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
            return
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        if diff != diff:  # NaN
            diff = float("inf")
        rel = diff / max(float(b.abs().max()) if b.numel() else 0.0, 1e-12)
        if diff > TOL and not first:
            first = f"{what}: {diff:.2e}"
        worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, rel)

    see("losses", actual["step_losses"], expected["step_losses"])
    for kind in ("grads", "states"):
        if len(actual[kind]) != len(expected[kind]):
            return float("inf"), float("inf"), f"{kind}: {len(actual[kind])} steps, expected {len(expected[kind])}"
        for step, (got, want) in enumerate(zip(actual[kind], expected[kind])):
            if got.keys() != want.keys():
                missing = sorted(set(want) ^ set(got))[:3]
                return float("inf"), float("inf"), f"{kind} after step {step + 1}: names differ {missing}"
            for name in want:
                if not (kind == "states" and name in warned):
                    see(f"{kind[:-1]} {name} after step {step + 1}", got[name], want[name])
    for key, value in expected["validation"].items():
        see(f"validation {key}", torch.tensor(actual["validation"].get(key, float("nan"))), torch.tensor(value))
    return worst_abs, worst_rel, first


_LIBRARY = os.sep + "lightning_parallel" + os.sep
#: The first lines of torch errors that lightning_parallel rewrites (``DataParallelComponent.on_exception``).
EXPLAINED = ("Your LightningModule has parameters that did not take part in the loss",
             "A parameter of your LightningModule got its gradient outside the autograd graph DDP saw")
_TORCH = os.sep + "torch" + os.sep


def _frame(filename: str, lineno: int, name: str) -> str:
    for marker in (_LIBRARY, _TORCH):
        if marker in filename:
            return f"{marker.strip(os.sep)}/{filename.split(marker, 1)[1]}:{lineno} in {name}"
    return f"{Path(filename).name}:{lineno} in {name}"


def _raise_statement(filename: str, lineno: int) -> bool:
    """Whether line ``lineno`` of ``filename`` lies in a ``raise <exception>`` statement (the innermost statement that
    spans it; a bare ``raise`` re-raises an error made elsewhere and does not count)."""
    tree = _parsed(filename)
    if tree is None:
        return False
    innermost = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and node.lineno <= lineno <= (node.end_lineno or node.lineno):
            if innermost is None or (node.end_lineno - node.lineno) <= (innermost.end_lineno - innermost.lineno):
                innermost = node
    return isinstance(innermost, ast.Raise) and innermost.exc is not None


@functools.lru_cache(maxsize=None)
def _parsed(filename: str) -> ast.Module | None:
    try:
        return ast.parse(Path(filename).read_text())
    except (OSError, SyntaxError, ValueError):
        return None


#: What the library raises when it refuses (DESIGN.md: ValueError bad config, TypeError misuse, RuntimeError wrong order).
REFUSALS = (ValueError, TypeError, RuntimeError, NotImplementedError)


def raised_by_library(error: BaseException) -> bool:
    """Whether ``error`` is one the library raises on purpose: made by a ``raise SomeError(...)`` statement in a
    lightning_parallel source file, of a refusal's type.

    Where the innermost frame is the library's does not make it ours: a torch operator the library calls (its torch
    function modes run every operator of the model: ``return func(*args, **kwargs)``) raises its own error from the
    library's frame, and a bare ``raise`` passes torch's error on. A ``raise ...Error(message) from error`` that
    translates torch's error is the library's: its message is written here (the cause, and what to do).
    """
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or not isinstance(error, REFUSALS):
        return False
    innermost = frames[-1]
    return _LIBRARY in innermost.filename and _raise_statement(innermost.filename, innermost.lineno)


def describe_failure(error: BaseException, trained_steps: int) -> dict[str, Any]:
    """``refused`` (an error the library raises on purpose, at setup or the first batch: :func:`raised_by_library`,
    or a torch error the library rewrites) or ``crash`` (any other error, wherever it was raised), with where it
    came from."""
    frames = traceback.extract_tb(error.__traceback__)
    raised_here = frames[-1] if frames else None
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    ours = raised_by_library(error) and trained_steps == 0
    # An error torch raises (DDP's, at the step after the one that left a parameter unused) that our library
    # rewrites into what and why and the fix is refused too: the user reads our message, not a crash.
    explained = any(phrase in first_line for phrase in EXPLAINED)
    origin = next((f for f in reversed(frames) if _LIBRARY in f.filename or _TORCH in f.filename), raised_here)
    library = next((f for f in reversed(frames) if _LIBRARY in f.filename), None)
    record = {
        "status": "refused" if ours or explained else "crash",
        "error": type(error).__name__,
        "message": first_line,
        "where": _frame(origin.filename, origin.lineno, origin.name) if origin else "",
    }
    if library is not None and library is not origin:
        record["library_frame"] = _frame(library.filename, library.lineno, library.name)
    return record


def judge(layout: str, expected: dict[str, Any], result: dict[str, Any], largest_bytes: int) -> dict[str, Any]:
    """The cell's verdict from rank 0's findings and the largest rank's parameter bytes."""
    worst_abs, worst_rel, first = compare(expected, result)
    record: dict[str, Any] = {"max_abs_diff": worst_abs, "max_rel_diff": worst_rel}
    allowed = tolerance(expected)
    if allowed > TOL:  # the family computes in float32 somewhere: judged against its measured floor
        record["tolerance"] = allowed
    if result.get("settings"):
        record["settings"] = result["settings"]
    if result.get("divergent_buffers"):  # not compared: named by the strategy's warning, not silently different
        record["divergent_buffers_warned"] = result["divergent_buffers"]
    if layout in ("dp2", "ep2") and result.get("replica_spread", 0.0) > 1e-9:
        worst_abs = max(worst_abs, result["replica_spread"])
        first = first or f"replicas differ by {result['replica_spread']:.2e}"
    if worst_abs > allowed:
        return {**record, "status": "wrong", "first_difference": first}
    record["status"] = "exact"
    if layout.startswith("ep"):  # what dividing the experts saves (no goal: dense parameters stay whole)
        record["share"] = round(largest_bytes / expected["local_bytes"], 3)
    if layout.startswith("tp"):
        share = largest_bytes / expected["local_bytes"]
        record["share"] = round(share, 3)
        if share > SHARE:
            record["status"] = f"exact (share {share:.2f})"
    return record


def timed(function: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    value = function(*args)
    return value, time.perf_counter() - start
