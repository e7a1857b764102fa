"""Vocabulary-parallel lookups reduced where they happen, for embeddings that compute more than the lookup.

A lookup in a vocabulary-sharded table (torch's ``RowwiseParallel`` on an ``nn.Embedding``) gives a masked
partial sum whose mask DTensor keeps only until the next op. An embedding subclass that scales its rows in its
own forward (Gemma's ``embed_scale``) passes it on, the mask is lost, and the reduction after the module fails.
:func:`reduce_lookups_in` reduces each lookup inside such a module's forward instead, as a traced pipeline stage
does for its embedding nodes. No Lightning here.
"""

from __future__ import annotations

import sys
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



def gather_reads_elsewhere(fqn: str, embedding: nn.Module, ancestors: list[nn.Module], warn: Any) -> None:
    """Let the model's own code read a vocabulary-split embedding's (or tied head's) ``weight`` (and ``bias``) outside
    its own forward.

    Some models read the token table directly (Gemma 4 takes its pad token's row, ``embed_tokens.weight[pad_id]``, to
    blank multimodal positions): on a rank's rows that read is a DTensor beside plain tensors, and the step stops
    deep in torch. While one of ``ancestors`` (the modules above the embedding) runs its forward, a read of ``weight``
    outside the embedding's own forward, by code of the files that define those modules (the model's), gets the whole
    table, gathered (``full_tensor()``: each rank's gradient goes back to its own rows), and ``warn`` names the module
    and the cost once. Everywhere else (the embedding's forward, FSDP2, checkpoints, optimizers, this library)
    ``weight`` is the split parameter.
    """
    from torch.distributed.tensor import DTensor

    state = {"ancestors": 0, "inside": 0, "warned": False}

    def count(key: str, step: int) -> Any:
        def hook(*_: Any) -> None:
            state[key] += step
        return hook

    embedding.register_forward_pre_hook(count("inside", 1))
    embedding.register_forward_hook(count("inside", -1), always_call=True)
    for ancestor in ancestors:
        ancestor.register_forward_pre_hook(count("ancestors", 1))
        ancestor.register_forward_hook(count("ancestors", -1), always_call=True)

    # The model's own code: the files defining the modules above the embedding. Reads from elsewhere while they run
    # (FSDP2's lazy init, this library) keep the split parameter.
    model_files = {type(ancestor).__module__ for ancestor in ancestors}

    def read(name: str) -> property:
        def whole_outside_forward(self: nn.Module) -> Tensor:
            param = self._parameters[name]
            if not (state["ancestors"] and not state["inside"] and isinstance(param, DTensor)):
                return param
            if sys._getframe(1).f_globals.get("__name__") not in model_files:
                return param
            if not state["warned"]:
                state["warned"] = True
                warn(f"{fqn}: the model reads its {name} outside {fqn}'s own forward; split over the vocabulary by "
                     f"tensor parallelism, it is gathered whole for each such read ({tuple(param.shape)}).")
            return param.full_tensor()

        return property(whole_outside_forward)

    # A tied head's bias is split with its weight (MobileBERT adds ``decoder.bias`` itself): read whole alike.
    names = [name for name in ("weight", "bias") if isinstance(embedding._parameters.get(name), DTensor)]
    base = type(embedding)
    embedding.__class__ = type(base.__name__, (base,), {**{name: read(name) for name in names}, "__module__": base.__module__})
