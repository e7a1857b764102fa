"""The equivalence check every layout's test uses: a run reproduces single-device training step by step.

Float64 runs of the same model on the same global batch differ only by the order of floating-point sums: ~1e-16 of a
step's largest gradient for float64 models (tp2, pp2, FSDP2, cp2 measured 2026-12-07: at most 6e-18 absolute), ~1e-6 of
a tensor's gradient for models that compute parts in float32 by design (transformers' Mixtral under tp2: 1.1e-8 on a
gradient of 1e-2 after 5 steps; its router softmax and RMSNorm cast to float32). The check must still see a wrong
gradient where it is small: attention's query/key gradients are 1e-7 of the embedding's after a few steps, and AdamW's
update is blind to a gradient's scale, so the weights do not show a doubled one. So a gradient is compared within
``GRAD_RTOL`` of its own largest element (100× the float32 models' drift), never more than ``TOL`` and never less than
``GRAD_FLOOR`` of the step's largest gradient element (some gradients are rounding noise around zero: a key
projection's bias does not change attention). ``tests/unit/test_equivalence_helpers.py`` feeds it broken copies of a
real run: a gradient doubled, a shard zeroed, a micro-batch's gradient skipped.
"""

from __future__ import annotations

import torch

#: Losses, weights and buffers: absolute (they are O(0.01-1)); the cap of every gradient's tolerance.
TOL = 1e-6
#: A gradient's tolerance: this fraction of its largest element ...
GRAD_RTOL = 1e-4
#: ... but never below this fraction of the step's largest gradient element (rounding noise around zero).
GRAD_FLOOR = 1e-9


def _scale(tensor: torch.Tensor) -> float:
    return float(tensor.abs().max()) if tensor.numel() else 0.0


def gradient_tolerance(expected: torch.Tensor, step_scale: float) -> float:
    """The absolute tolerance of one gradient tensor (see the module docstring)."""
    return min(TOL, max(GRAD_RTOL * _scale(expected), GRAD_FLOOR * step_scale))


def assert_same_training(reference: dict, result: dict, steps: int = 5) -> None:
    """Losses, gradients and parameters (+ buffers) agree after every optimizer step."""
    torch.testing.assert_close(result["step_losses"], reference["step_losses"], rtol=0, atol=TOL)
    assert len(result["states"]) == len(reference["states"]) == steps
    assert len(result["grads"]) == len(reference["grads"]) == steps
    for step in range(steps):
        for kind in ("grads", "states"):
            expected, actual = reference[kind][step], result[kind][step]
            assert actual.keys() == expected.keys()
            step_scale = max((_scale(t.double()) for t in expected.values()), default=0.0)
            for name in expected:
                atol = gradient_tolerance(expected[name].double(), step_scale) if kind == "grads" else TOL
                torch.testing.assert_close(
                    actual[name].double(), expected[name].double(), rtol=0, atol=atol,
                    msg=lambda m, name=name, kind=kind, step=step, atol=atol: f"{kind} of {name} after step {step + 1} (atol {atol:.3g}): {m}",
                )
    # Every replica ends with the same weights.
    assert result["replica_spread"] <= 1e-12
