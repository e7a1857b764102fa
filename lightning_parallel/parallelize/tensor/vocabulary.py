"""Vocabulary-parallel lookups reduced where they happen, for embeddings that compute more than the lookup.

A lookup in a vocabulary-sharded table (torch's ``RowwiseParallel`` on an ``nn.Embedding``) gives a masked
partial sum whose mask DTensor keeps only until the next op. An embedding subclass that scales its rows in its
own forward (Gemma's ``embed_scale``) passes it on, the mask is lost, and the reduction after the module fails.
:func:`reduce_lookups_in` reduces each lookup inside such a module's forward instead, as a traced pipeline stage
does for its embedding nodes. No Lightning here.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode


def replicate_partials(value: Tensor) -> Tensor:
    """``value`` reduced where it is a partial sum (a sharded lookup), as a fresh replicated DTensor."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(value, DTensor) and any(p.is_partial() for p in value.placements):
        placements = [Replicate() if p.is_partial() else p for p in value.placements]
        whole = value.redistribute(placements=placements).to_local()
        # A fresh DTensor: the gradient that comes back (often a partial sum) is reduced by from_local's
        # backward, and reaches the masked reduction as the replicated gradient it expects.
        return DTensor.from_local(whole, value.device_mesh, placements, run_check=False)
    return value


class _ReducedLookups(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return replicate_partials(out) if func is F.embedding else out


class _ForwardWithReducedLookups:
    """The module's own forward, run with every ``F.embedding`` result reduced on the spot."""

    def __init__(self, module: nn.Module) -> None:
        self.forward = type(module).forward.__get__(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _ReducedLookups():
            return self.forward(*args, **kwargs)


def reduce_lookups_in(module: nn.Embedding) -> None:
    """Make a vocabulary-split embedding whose forward is not ``nn.Embedding``'s reduce its lookup right away."""
    if type(module).forward is not nn.Embedding.forward:
        # An instance attribute shadows the class's forward: nn.Module.__call__ (and its hooks) call this one.
        module.forward = _ForwardWithReducedLookups(module)

