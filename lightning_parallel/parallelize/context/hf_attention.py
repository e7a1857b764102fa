"""transformers' written-out attention (``eager_attention_forward``) under context parallelism: run as the ring.

Families whose attention transformers writes out in matmuls — soft-capped logits (Gemma 2, VaultGemma), attention
sinks (gpt-oss and its kin) — never call ``F.scaled_dot_product_attention``, so context parallelism would see no
attention to split and refuses them. Each modeling module defines its own ``eager_attention_forward(module, query,
key, value, attention_mask, ...)``; while a model call runs under context parallelism the name points to a wrapper
that runs ring attention instead, with the function's scale, its ``softcap`` and the module's ``sinks``.

The wrapper does not trust that reading of the function: at its first call for a kind of module it runs the
function itself on this rank's part (its queries against its own keys, under its own part of the mask) and the ring's
kernel on the same part; only where they agree (to float32 rounding: transformers takes some of these softmaxes in
float32) does it run the ring, and otherwise the function as it is (attention within this rank's part only, which
the splitter then refuses: no attention ran as a ring). No Lightning here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.parallelize.context.kernels import MathKernel, additive_bias
from lightning_parallel.parallelize.context.masks import four_dims

#: (function, module class) -> the relative difference between the function and the ring's kernel on a rank's part
#: (float32 rounding where transformers takes the softmax in float32), or None where they disagree.
_AGREES: dict[tuple[int, type], float | None] = {}


def wrapped_attention(original: Callable[..., Any], current: Callable[[], Any]) -> Callable[..., Any]:
    """``original`` (an ``eager_attention_forward``), run as ring attention while a model call of ``current()``
    runs under context parallelism."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def attend(*args: Any, **kwargs: Any) -> Any:
        mode = current()
        if mode is None:
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        call = {**{k: p.default for k, p in signature.parameters.items() if p.default is not inspect.Parameter.empty},
                **bound.arguments, **bound.arguments.get("kwargs", {})}
        module, query, key, value = (call.get(name) for name in ("module", "query", "key", "value"))
        mask = call.get("attention_mask")
        if not isinstance(module, nn.Module) or not all(isinstance(t, Tensor) for t in (query, key, value)):
            return original(*args, **kwargs)
        scale = call.get("scaling")
        scale = getattr(module, "head_dim", query.size(-1)) ** -0.5 if scale is None else float(scale)
        softcap = call.get("softcap")
        sinks = getattr(module, "sinks", None)
        sinks = sinks if isinstance(sinks, Tensor) and sinks.shape == (query.size(1),) else None
        dropout = float(call.get("dropout") or 0.0) if module.training else 0.0
        agreed = (id(original), type(module))
        if agreed not in _AGREES:
            _AGREES[agreed] = _agrees(original, args, kwargs, mode, query, key, value, mask, scale, softcap, sinks)
        if _AGREES[agreed] is None:
            return original(*args, **kwargs)
        mode.rounding = max(mode.rounding, _AGREES[agreed])
        out = mode.attend(query, key, value, mask, scale=scale, enable_gqa=True, softcap=softcap, sinks=sinks,
                          dropout=dropout)
        return out.transpose(1, 2).contiguous(), None

    attend._context_parallel_original = original  # type: ignore[attr-defined]
    attend._context_parallel_kind = "attention"  # type: ignore[attr-defined]
    return attend


def _agrees(original: Callable[..., Any], args: tuple, kwargs: dict, mode: Any, query: Tensor, key: Tensor,
            value: Tensor, mask: Tensor | None, scale: float, softcap: float | None, sinks: Tensor | None
            ) -> float | None:
    """The relative difference between the function and the ring's kernel on this rank's queries × its own keys,
    under its block of the mask (``None``: they compute different things)."""
    layout = mode.layout
    block = None if mask is None else _own_block(four_dims(mask), layout)
    with torch.no_grad(), mode.suspended():
        if mask is not None and block is None:
            return None
        swapped = _with_mask(original, args, kwargs, block)
        expected = original(*swapped[0], **swapped[1])[0]
        groups = query.size(1) // key.size(1)
        kernel = MathKernel(softcap)
        bias = None if block is None else additive_bias(block, query.dtype)
        out, lse, _ = kernel.forward(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), bias,
                                     False, scale)
        if sinks is not None:
            total = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
            out = out * (lse - total).exp().unsqueeze(-1)
        got = out.transpose(1, 2)
        if expected.shape != got.shape:
            return None
        tolerance = 1e-5 if query.dtype == torch.float64 else 1e-3
        difference = float(((expected.to(got.dtype) - got).abs().max() / expected.abs().max().clamp_min(1e-30)).item())
        return difference if difference < tolerance else None


def _own_block(mask: Tensor, layout: Any) -> Tensor | None:
    """``mask``'s block of this rank's queries × its own keys (rows and columns of the whole length taken at this
    rank's positions)."""
    positions = layout.positions(mask.device)
    rows, columns = mask.shape[-2:]
    if rows == layout.length:
        mask = mask.index_select(-2, positions)
    elif rows not in (layout.local_length, 1):
        return None
    if columns == layout.length:
        mask = mask.index_select(-1, positions)
    elif columns not in (layout.local_length, 1):
        return None
    return mask


def _with_mask(original: Callable[..., Any], args: tuple, kwargs: dict, mask: Tensor | None) -> tuple[tuple, dict]:
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.arguments["attention_mask"] = mask
    return bound.args, bound.kwargs


__all__ = ["wrapped_attention"]
