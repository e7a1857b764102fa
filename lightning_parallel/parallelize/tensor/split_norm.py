"""A norm over every head together (OLMo2's ``q_norm``/``k_norm``, BitNet's ``attn_sub_norm``) run on this rank's slice.

Some attentions normalise a split projection's *whole* output (``n_heads · head_dim`` features) rather than each
head: OLMo2, OLMo3, OLMoE and FlexOlmo (``q_norm``/``k_norm`` after ``q_proj``/``k_proj``), BitNet (before
``o_proj``), ESM-C. After a column split a rank holds ``1/tp`` of those features, so the norm's statistic (the
mean square, or mean and variance) needs every rank's slice. Megatron computes such statistics with one
all-reduce; this does the same without changing the model's code:

- the norm is recognised by what it computes, not by its class: its own forward, on a random input of the whole
  width, must match an RMSNorm (``w · x / rms``, or ``(1 + w)`` as Gemma writes it) or a LayerNorm (with or
  without bias), in float32 or in the input's dtype, with the module's own ``eps``;
- on a slice, the sums behind the statistic are all-reduced over the tensor-parallel group (torch's autograd
  all-reduce: the statistic's gradient, a partial sum on each rank, is all-reduced too), and the slice is
  scaled by this rank's part of the weight (and bias);
- the weight stays whole on every rank: its gradient (this rank's part non-zero) is a partial sum, reduced after
  backward with the other replicated parameters a split region uses
  (:class:`~lightning_parallel.parallelize.tensor.split_region.SplitRegionParameters`).

Called on the whole width (a norm the model also uses before the split), it runs its own forward. A norm whose
math is not recognised keeps the error it had: the region must stay replicated. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

#: Attribute names under which norms keep their epsilon.
EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")


def norm_like(module: nn.Module) -> bool:
    """``module`` holds only a 1-D ``weight`` (and a ``bias`` of its width) and a float epsilon: it may be a norm
    that :class:`SplitWidthNorm` can run on a slice (its call decides)."""
    params = dict(module.named_parameters())
    weight = params.get("weight")
    if weight is None or weight.dim() != 1 or set(params) - {"weight", "bias"}:
        return False
    if "bias" in params and params["bias"].shape != weight.shape:
        return False
    return norm_eps(module) is not None


@dataclass(frozen=True)
class NormMath:
    """What a norm computes. ``rms``: mean square (else mean and variance); ``offset``: the weight applied as
    ``offset + w``; ``compute_dtype``: the dtype the statistic is computed in (``None``: the input's)."""

    rms: bool
    offset: float
    compute_dtype: torch.dtype | None


class SplitWidthNorm:
    """The forward of a norm whose width a column split divides (see the module docstring).

    Installed as the module's ``forward`` (an instance attribute); calls of the whole width go to ``original``.

    Args:
        module: The norm.
        group: The tensor-parallel process group.
        tp_size, tp_rank: The group's size and this rank's place in it (its slice is the ``tp_rank``-th).
        name: The norm's FQN, for messages.
    """

    def __init__(self, module: nn.Module, group: Any, tp_size: int, tp_rank: int, name: str) -> None:
        self.module, self.group, self.tp_size, self.tp_rank, self.name = module, group, tp_size, tp_rank, name
        self.original: Callable[..., Any] = type(module).forward.__get__(module)
        self.math: NormMath | None = None

    def handles(self, width: int) -> bool:
        """A call on ``width`` features is a slice of this norm's whole width."""
        whole = self.module.weight.shape[0]
        return width * self.tp_size == whole and width != whole

    def __call__(self, hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args or kwargs or not isinstance(hidden, Tensor) or not self.handles(hidden.shape[-1]):
            return self.original(hidden, *args, **kwargs)
        if self.math is None:
            self.math = self._recognise(hidden)
        return self._on_slice(hidden, self.math)

    def _recognise(self, hidden: Tensor) -> NormMath:
        math = recognise_norm(self.module, hidden.dtype)
        if math is None:
            whole = self.module.weight.shape[0]
            raise RuntimeError(
                f"{self.name} has the whole split width {whole}, but is applied to this rank's {whole // self.tp_size} "
                f"features (a norm over all heads together, not per head), and what it computes is not an RMSNorm or "
                f"LayerNorm whose statistic could be summed over the ranks. Leave the module holding it replicated: give "
                f"TensorParallelStrategy(plan={{pattern: style}}) without its projections."
            )
        return math

    def _on_slice(self, hidden: Tensor, math: NormMath) -> Tensor:
        local = hidden.shape[-1]
        start = self.tp_rank * local
        weight = self.module.weight.narrow(0, start, local)
        bias = getattr(self.module, "bias", None)
        bias = bias.narrow(0, start, local) if isinstance(bias, Tensor) else None
        return _normalise(hidden, math, norm_eps(self.module), weight, bias, self._summed, local * self.tp_size)

    def _summed(self, partial: Tensor) -> Tensor:
        from lightning_parallel.parallelize.common.meta_run import summed_with_gradient

        return summed_with_gradient(partial, self.group)


def recognise_norm(module: nn.Module, dtype: torch.dtype | None = None) -> NormMath | None:
    """What ``module`` (:func:`norm_like`) computes, found by running its own forward (hooks bypassed) on a random
    input of its whole width; ``None`` if it is none of the norms :class:`NormMath` describes. A module on the meta
    device (a planner's dry run) is recognised on a CPU copy with random parameters: its math, not its values,
    decides."""
    if not norm_like(module):
        return None
    if module.weight.device.type == "meta":
        module = _cpu_stand_in(module)
    weight = module.weight
    generator = torch.Generator(device=weight.device).manual_seed(0)  # the user's random stream stays untouched
    sample = torch.randn(3, weight.shape[0], generator=generator, device=weight.device, dtype=dtype or weight.dtype) * 3 + 0.5
    with torch.no_grad():
        expected = type(module).forward(module, sample)
        if not isinstance(expected, Tensor) or expected.shape != sample.shape:
            return None
        scale = expected.abs().max().clamp_min(1e-30)
        for rms in (True, False):
            for offset in (0.0, 1.0):
                for compute_dtype in (torch.float32, None):
                    math = NormMath(rms, offset, compute_dtype)
                    got = _normalise(sample, math, norm_eps(module), weight, getattr(module, "bias", None), lambda t: t, sample.shape[-1])
                    if float((got - expected).abs().max() / scale) < 1e-5:
                        return math
    return None


def _cpu_stand_in(module: nn.Module) -> nn.Module:
    """A CPU stand-in of a meta norm for its class's forward: its attributes shared (not copied: a forward installed
    on it may hold a process group), its parameters random (seeded: the user's random stream stays untouched) so
    that a weight applied as ``w`` or as ``1 + w`` tell apart."""
    import copy

    stand_in = copy.copy(module)
    generator = torch.Generator().manual_seed(1)
    stand_in._parameters = {
        name: None if p is None else nn.Parameter(torch.rand(p.shape, generator=generator, dtype=p.dtype) + 0.5)
        for name, p in module._parameters.items()
    }
    stand_in._buffers = {name: None if b is None else torch.zeros(b.shape, dtype=b.dtype) for name, b in module._buffers.items()}
    return stand_in


def _normalise(
    hidden: Tensor, math: NormMath, eps: float, weight: Tensor, bias: Tensor | None,
    summed: Callable[[Tensor], Tensor], width: int,
) -> Tensor:
    """``hidden`` normalised by statistics over ``width`` features, from sums completed by ``summed``."""
    x = hidden.to(math.compute_dtype) if math.compute_dtype is not None else hidden
    if math.rms:
        normalised = x * torch.rsqrt(summed(x.pow(2).sum(-1, keepdim=True)) / width + eps)
    else:
        centred = x - summed(x.sum(-1, keepdim=True)) / width
        normalised = centred * torch.rsqrt(summed(centred.pow(2).sum(-1, keepdim=True)) / width + eps)
    out = normalised.to(hidden.dtype) * (weight + math.offset if math.offset else weight)
    return out + bias if bias is not None else out


def norm_eps(module: nn.Module) -> float | None:
    """The epsilon a norm module keeps (under any of :data:`EPS_ATTRIBUTES`), or ``None``."""
    for name in EPS_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def install_split_width_norms(region: nn.Module, name: str, children: dict[str, nn.Module], mesh: Any) -> None:
    """Make every norm-like child of ``region`` runnable on a slice of its width (:class:`SplitWidthNorm`)."""
    for child, sub in children.items():
        if norm_like(sub) and not isinstance(getattr(sub, "forward", None), SplitWidthNorm):
            sub.forward = SplitWidthNorm(sub, mesh.get_group(), mesh.size(), mesh.get_local_rank(), f"{name}.{child}")
