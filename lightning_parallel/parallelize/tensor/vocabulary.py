"""Vocabulary-parallel lookups reduced where they happen, for embeddings that compute more than the lookup.

A lookup in a vocabulary-sharded table (torch's ``RowwiseParallel`` on an ``nn.Embedding``) gives a masked
partial sum whose mask DTensor keeps only until the next op. An embedding subclass that scales its rows in its
own forward (Gemma's ``embed_scale``) passes it on, the mask is lost, and the reduction after the module fails.
:func:`reduce_lookups_in` reduces each lookup inside such a module's forward instead, as a traced pipeline stage
does for its embedding nodes.

:func:`split_lookup_backward` gives such a table a backward of its own rows. DTensor's strategies for
``embedding_dense_backward`` (torch 2.13) offer no split over the vocabulary: the lookup's gradient comes back for
the whole table on every rank, tp times a rank's rows, beside the state, at the end of every backward (an untied
table keeps it whole until the optimizer step). :class:`_SplitLookup` computes each rank's rows only, as Megatron's
vocabulary-parallel embedding does: the positions whose token is another rank's are masked out. No Lightning here.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function
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
        if func is not F.embedding:
            return func(*args, **(kwargs or {}))
        # torch leaves this mode while it runs a call: the lookup's own F.embedding does not come back here.
        return replicate_partials(split_lookup(*args, **(kwargs or {})))


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


def split_lookup_backward(module: nn.Embedding) -> None:
    """Make a vocabulary-split ``nn.Embedding`` compute its weight's gradient for this rank's rows only."""
    if type(module).forward is nn.Embedding.forward:
        # An instance attribute shadows the class's forward: nn.Module.__call__ (and torch's hooks) call this one.
        module.forward = _SplitLookupForward(module)


class _SplitLookupForward:
    def __init__(self, module: nn.Embedding) -> None:
        self.module = module

    def __call__(self, input: Tensor) -> Tensor:
        m = self.module
        return split_lookup(input, m.weight, m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq, m.sparse)


def split_lookup(input: Tensor, weight: Tensor, padding_idx: int | None = None, max_norm: float | None = None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:
    """``F.embedding`` whose backward computes the gradient of this rank's rows of a vocabulary-split ``weight`` only.

    Anything but a plain lookup of every rank's whole ``input`` in a table split over its rows on a one-dimensional
    mesh (a renormalising ``max_norm``, gradients scaled by frequency: counted over every position, sparse gradients,
    a compiled forward) is torch's lookup, whose backward computes the whole table. A traced pipeline stage's lookups
    come here through :func:`aten_split_lookup`.
    """
    import torch
    from torch.distributed.tensor import DTensor

    plain = (
        not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or not weight.placements[0].is_shard(0)
        or (isinstance(input, DTensor) and not all(p.is_replicate() for p in input.placements))
        or max_norm is not None or scale_grad_by_freq or sparse or not weight.requires_grad
        or not torch.is_grad_enabled() or torch.compiler.is_compiling()
    )
    if plain:
        return F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    return _SplitLookup.apply(input, weight, padding_idx)


def aten_split_lookup(weight: Tensor, indices: Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False,
                      sparse: bool = False) -> Tensor:
    """:func:`split_lookup` called as ``aten.embedding`` is (its arguments, ``-1``: no padding row): what a traced graph's
    lookup nodes run instead, so that a traced pipeline stage's backward computes this rank's rows too."""
    return split_lookup(indices, weight, None if padding_idx == -1 else padding_idx, None, 2.0, scale_grad_by_freq, sparse)


class _SplitLookup(Function):
    """Forward: torch's vocabulary-split lookup (a masked partial sum, reduced after the module). Backward: this rank's
    rows of the weight's gradient, from the positions whose token falls in them (exact: the same sums, row by row,
    as the whole table's gradient has)."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor, padding_idx: int | None) -> Tensor:
        from torch.distributed.tensor import DTensor

        ctx.ids = input.to_local() if isinstance(input, DTensor) else input
        ctx.padding_idx, ctx.mesh, ctx.placements = padding_idx, weight.device_mesh, weight.placements
        ctx.shape, ctx.stride, ctx.rows = weight.shape, weight.stride(), weight.to_local().shape[0]
        return F.embedding(input, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[None, Tensor, None]:
        import torch
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.placement_types import Shard, _MaskPartial

        if isinstance(grad_output, DTensor):
            grad_output = grad_output.redistribute(ctx.mesh, [Replicate()]).to_local()
        # This rank's rows, and its tokens among them, as torch's masked lookup finds them (private, checked against
        # torch 2.13: its coordinate is also right for ranks simulated in one process, LocalTensorMode).
        rows, first = Shard.local_shard_size_and_offset(ctx.shape[0], ctx.mesh.size(0), ctx.mesh._sym_get_coordinate(0))
        elsewhere, ids = _MaskPartial._mask_tensor(ctx.ids, first, rows)
        grad_output = grad_output.masked_fill(elsewhere.unsqueeze(-1), 0)
        grad = torch.ops.aten.embedding_dense_backward(grad_output, ids, ctx.rows, -1, False)
        if ctx.padding_idx is not None:  # the padding row, on whichever rank holds it, gets no gradient
            row = torch.arange(ctx.rows, device=grad.device) + first
            grad = grad.masked_fill((row == ctx.padding_idx).unsqueeze(-1), 0)
        return None, DTensor.from_local(grad, ctx.mesh, ctx.placements, run_check=False, shape=ctx.shape, stride=ctx.stride), None
