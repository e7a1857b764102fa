"""Mixture-of-Experts load-balancing losses made global over the ranks that split the batch.

transformers' MoE families add ``router_aux_loss_coef · load_balancing_loss_func(router_logits, ...)`` to the
loss when the config sets ``output_router_logits=True``. That loss is ``E · Σ_e f_e · P_e``: the fraction of
tokens routed to each expert times its mean router probability — a product of batch means. On a rank that holds
part of the batch (data parallelism) or part of each sequence (context parallelism) it is the product of *that
part's* means, which is not the global batch's, so averaging it over the ranks silently changes the objective.

:func:`global_load_balancing` calls the model's own function on every rank's router logits instead: each rank
all-gathers the logits (and the attention mask) of its replica group along the token dimension, differentiably,
so every rank computes the one-device value. The gather's backward sums the ranks' identical gradients
(``n`` times one rank's), which the data-parallel gradient average divides by ``n`` again: the router's gradient
is the one-device gradient. Uneven token counts (dynamic padding) are padded with masked rows. No Lightning here.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

#: The module-level function transformers' MoE modeling files define and call from their ``forward``.
FUNCTION = "load_balancing_loss_func"


def load_balancing_modules(module: nn.Module) -> list[ModuleType]:
    """The modeling modules whose ``load_balancing_loss_func`` ``module``'s submodules may call (whether a call
    asks for router logits is decided per call, so every module defining one is taken).

    Raises:
        ValueError: A submodule's config asks for the loss (``output_router_logits`` with a non-zero
            ``router_aux_loss_coef``) from a function that does not take ``gate_logits`` and ``attention_mask``
            (another signature: it cannot be made global here).
    """
    found: dict[str, ModuleType] = {}
    for name, sub in module.named_modules():
        python_module = sys.modules.get(type(sub).__module__)
        function = getattr(python_module, FUNCTION, None)
        if python_module is None or not callable(function):
            continue
        if {"gate_logits", "attention_mask"} <= set(inspect.signature(function).parameters):
            found[python_module.__name__] = python_module
            continue
        config = getattr(sub, "config", None)
        if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 1.0):
            raise ValueError(
                f"{name or type(sub).__name__} ({type(sub).__name__}) adds a load-balancing loss "
                f"(output_router_logits=True) that each rank would compute from its own tokens only, and its "
                f"{python_module.__name__}.{FUNCTION} cannot be made global. Set output_router_logits=False (or "
                "router_aux_loss_coef=0), or train it on one rank."
            )
    return list(found.values())


@contextmanager
def global_load_balancing(modules: list[ModuleType], group: dist.ProcessGroup | None) -> Iterator[None]:
    """Inside: each of ``modules``' ``load_balancing_loss_func`` computes the loss over ``group``'s tokens."""
    if not modules or group is None or dist.get_world_size(group) == 1:
        yield
        return
    originals = {m: getattr(m, FUNCTION) for m in modules}
    for m, original in originals.items():
        setattr(m, FUNCTION, _over_group(original, group))
    try:
        yield
    finally:
        for m, original in originals.items():
            setattr(m, FUNCTION, original)


def _over_group(original: Callable[..., Any], group: dist.ProcessGroup) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @wraps(original)
    def load_balancing_loss_func(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        gate_logits = call.arguments["gate_logits"]
        if not isinstance(gate_logits, tuple) or not gate_logits:
            return original(*args, **kwargs)  # the model's own "no logits" answer
        call.arguments["gate_logits"], call.arguments["attention_mask"] = _gathered(
            gate_logits, call.arguments["attention_mask"], group
        )
        return original(*call.args, **call.kwargs)

    return load_balancing_loss_func


def _gathered(gate_logits: tuple[Tensor, ...], attention_mask: Tensor | None, group: dist.ProcessGroup) -> tuple[tuple[Tensor, ...], Tensor | None]:
    """Every rank's router logits (one ``[tokens, experts]`` tensor per layer) and mask rows, in rank order."""
    rows = gate_logits[0].size(0)
    mask = None if attention_mask is None else attention_mask.reshape(-1)
    if mask is not None and mask.numel() != rows:
        raise ValueError(
            f"The load-balancing loss got router logits for {rows} tokens and an attention mask of {mask.numel()}: "
            "they must describe the same tokens to be made global over the ranks."
        )
    # Agree on the shapes first: token counts may differ per rank (dynamic padding), and so may having a mask.
    info = torch.tensor([rows, int(mask is not None)], device=gate_logits[0].device)
    every = collectives.functional_all_gather(info, 0, group).view(-1, 2)
    counts, masked = every[:, 0].tolist(), bool(every[:, 1].any())
    padded = max(counts)
    if masked or len(set(counts)) > 1:
        local = torch.ones(rows, device=info.device) if mask is None else mask.to(torch.float32)
        mask = torch.nn.functional.pad(local, (0, padded - rows))
        mask = collectives.functional_all_gather(mask, 0, group).view(1, -1)
    pad = padded - rows
    logits = tuple(
        collectives.functional_all_gather_autograd(torch.nn.functional.pad(layer, (0, 0, 0, pad)) if pad else layer, 0, group)
        for layer in gate_logits
    )
    return logits, mask
from lightning_parallel import collectives
