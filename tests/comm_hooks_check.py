"""What a DDP gradient-compression hook must hand the optimizer, checked against a float64 replay of each step.

A lossy hook's run leaves exact training after its first compressed step, so its gradients cannot be compared with a
single-device run's. Instead each recorded step is replayed here: the recipe GPT is loaded with the weights the run
had before that step (the state it recorded after the previous one), each replica's gradient is computed on its own
rows of the global batch in float64, and the run's reduced gradient is checked against what the hook may return:

* ``fp16`` (``bf16``): every element within the rounding of ``fp16(g_0)/2 + fp16(g_1)/2`` summed in fp16 (2^-11,
  bf16 2^-8, of each replica's magnitude and of the sum's, plus the subnormal spacing) of the exact average;
* ``powersgd``: the exact average (float64) before ``start_iter`` and for the tensors PowerSGD leaves uncompressed;
  after it, each compressed matrix is the projection ``U Uᵀ M`` of ``M`` = exact average + the replicas' mean
  error-feedback memory onto its own rank-``r`` column space ``U``, and that memory then becomes ``M`` − the output.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.harness import JobSpec, build


def replay_replica_grads(spec: JobSpec, result: dict[str, Any], world: int = 2) -> list[list[dict[str, torch.Tensor]]]:
    """For each recorded step, each replica's float64 gradient at the weights the run had before that step.

    ``spec`` is the distributed job (recipe GPT, data parallelism over ``world`` replicas, no accumulation).
    """
    assert spec.model == "gpt" and spec.accumulate == 1 and spec.precision == "64-true", spec
    single = JobSpec(model=spec.model, batch_size=spec.batch_size * world, steps=spec.steps, n_layer=spec.n_layer,
                     n_embd=spec.n_embd, tie_weights=spec.tie_weights, seed=spec.seed)
    model, data, _, _ = build(single)  # the run's initial weights (rank 0's) and its global batch order
    model = model.double()
    data.setup("fit")
    batches = iter(data.train_dataloader())
    per_step = []
    for step in range(len(result["grads"])):
        if step > 0:  # the weights the run had before this step
            model.load_state_dict(result["states"][step - 1])
        idx, targets = next(batches)
        replicas = []
        for rank in range(world):
            # Lightning's DistributedSampler deals the permutation out round robin: replica r's rows of global
            # micro-batch k are rows r, r + W, ... of block k of the one-replica order.
            model.zero_grad(set_to_none=True)
            loss, _, _ = model._loss((idx[rank::world], targets[rank::world]))
            loss.backward()
            replicas.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        per_step.append(replicas)
    return per_step


def exact_average(replicas: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: sum(r[name] for r in replicas) / len(replicas) for name in replicas[0]}


def _scale(tensor: torch.Tensor) -> float:
    return float(tensor.abs().max()) if tensor.numel() else 0.0


def assert_compressed_hook_gradients(
    result: dict[str, Any], replicas_per_step: list[list[dict[str, torch.Tensor]]], dtype: torch.dtype = torch.float16
) -> dict[str, float]:
    """Every reduced gradient element lies within the ``fp16``/``bf16`` hook's rounding of the exact average; returns
    ``{"worst_ratio": max error / bound, "max_error": max absolute error}`` (the hook did round: max_error > 0)."""
    unit_roundoff = torch.finfo(dtype).eps / 2  # fp16 2^-11, bf16 2^-8
    subnormal_spacing = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # fp16 2^-24
    worst, max_error = 0.0, 0.0
    assert len(result["grads"]) == len(replicas_per_step)
    for step, replicas in enumerate(replicas_per_step):
        exact = exact_average(replicas)
        assert result["grads"][step].keys() == exact.keys()
        for name, expected in exact.items():
            actual = result["grads"][step][name].double()
            # Each replica's gradient rounded to the hook's dtype and halved (the unit roundoff of its magnitude each),
            # their sum rounded once more (of the sum's), each rounding at most the subnormal spacing near zero.
            magnitude = sum(r[name].abs() for r in replicas) / len(replicas)
            bound = unit_roundoff * (magnitude + expected.abs()) * 1.01 + 2 * subnormal_spacing
            error = (actual - expected).abs()
            ratio = float((error / bound).max())
            worst, max_error = max(worst, ratio), max(max_error, float(error.max()))
            assert ratio <= 1, (
                f"{dtype} hook: gradient of {name} at step {step + 1} is {ratio:.3g}× the rounding bound away from the "
                f"exact average (max error {float(error.max()):.3g}, gradient scale {_scale(expected):.3g})"
            )
    return {"worst_ratio": worst, "max_error": max_error}


def powersgd_compresses(shape: torch.Size, rank: int, min_compression_rate: float = 2.0) -> bool:
    """Whether torch's PowerSGD hook compresses a gradient of this shape (its ``_should_compress``: the tensor viewed
    as ``shape[0] × rest`` is compressed when ``(rows + cols) · rank · min_compression_rate < rows · cols``)."""
    rows = shape[0] if len(shape) else 1
    cols = max(1, int(torch.Size(shape).numel()) // max(rows, 1))
    rank = min(rows, cols, rank)
    return (rows + cols) * rank * min_compression_rate < rows * cols


def assert_powersgd_hook_gradients(
    result: dict[str, Any], replicas_per_step: list[list[dict[str, torch.Tensor]]], rank: int, start_iter: int,
    rtol: float = 1e-9,
) -> dict[str, float]:
    """Exact before ``start_iter`` and where PowerSGD does not compress; after it, each compressed gradient is the
    rank-``rank`` projection of (exact average + mean error memory) onto its own column space. Returns the largest
    relative residual and the largest relative gap between a compressed gradient and the exact average."""
    memory: dict[str, torch.Tensor] = {}
    worst, compression_gap = 0.0, 0.0
    for step, replicas in enumerate(replicas_per_step):
        exact = exact_average(replicas)
        assert result["grads"][step].keys() == exact.keys()
        # Relative to the step's largest gradient at least: some are rounding noise around 0 (a key projection's
        # bias does not change attention), which an exact all-reduce reproduces only to float64's last bits.
        floor = max(_scale(g) for g in exact.values())
        for name, expected in exact.items():
            actual = result["grads"][step][name].double()
            compressed = step >= start_iter and powersgd_compresses(expected.shape, rank)
            if not compressed:
                target = expected
            else:
                matrix = (expected + memory.get(name, torch.zeros_like(expected))).reshape(expected.shape[0], -1)
                out = actual.reshape(matrix.shape)
                kept = min(rank, *matrix.shape)
                svd = torch.linalg.svd(out, full_matrices=False)
                if float(svd.S[0]) <= 1e-12 * float(torch.linalg.matrix_norm(matrix, 2)):
                    svd = torch.linalg.svd(matrix, full_matrices=False)  # no column space (a zeroed output): M's own
                columns = svd.U[:, :kept]
                target = (columns @ (columns.T @ matrix)).reshape(expected.shape)
                memory[name] = (matrix - out).reshape(expected.shape)
                compression_gap = max(compression_gap, _scale(actual - expected) / max(_scale(expected), floor))
            residual = _scale(actual - target) / max(_scale(target), _scale(expected), floor)
            worst = max(worst, residual)
            assert residual <= rtol, (
                f"powersgd hook: gradient of {name} at step {step + 1} ({'compressed' if compressed else 'exact'}) is "
                f"{residual:.3g} (relative) from what the hook must return"
            )
    return {"worst_residual": worst, "compression_gap": compression_gap}


def mutated(result: dict[str, Any], step: int, how: str) -> dict[str, Any]:
    """A copy of ``result`` whose gradients at ``step`` are zeroed, negated or doubled (a broken hook)."""
    broken = copy.copy(result)
    broken["grads"] = [dict(g) for g in result["grads"]]
    change = {"zeroed": lambda g: torch.zeros_like(g), "negated": lambda g: -g, "doubled": lambda g: 2 * g}[how]
    broken["grads"][step] = {name: change(g) for name, g in result["grads"][step].items()}
    return broken
