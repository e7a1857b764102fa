"""Sequence parallelism on top of a tensor-parallel plan (Megatron-style SP, as in torchtitan).

Between the tensor-parallel regions, the residual stream of each transformer block is split along the
sequence dimension instead of being replicated: norms and dropout work on 1/TP of the tokens, the
row-wise projections reduce-scatter (instead of all-reduce) into sequence shards, and each attention or
MLP submodule all-gathers the full sequence on entry. The trunk's first block scatters its input and the
last block gathers its output, so everything around the trunk (embeddings, final norm, head) is unchanged.

Derived from a resolved plan: the trunk is the ``nn.ModuleList`` whose blocks contain split layers; the
regions are the parents of column-wise projections inside a block.

A module of a block that the plan keeps whole (Falcon's and GPT-BigCode's multi-query attention: one key/value
head cannot be split) computes as on one device only on the whole sequence: fed this rank's tokens, attention
mixes a part of the sequence (and crashes where it applies rotary tables of the whole length), and its replicated
parameters would get this rank's partial gradients, which nothing sums. So each such module (a block's child that
holds parameters, is no norm, and contains nothing the plan splits) gathers the sequence on entry and keeps this
rank's part of its output: every rank computes it whole, as without sequence parallelism (its gradients are whole
on every rank; one all-gather in forward, one in backward). Norms inside it run on the whole sequence too.
Parameters a block holds itself (Doge's per-feature residual scales ``input_residual``, ``post_attention_residual``)
are used on this rank's tokens: their gradients are summed over the group after backward, with the split regions'.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_parallel.parallelize.tensor.region_input import map_hidden_states
from lightning_parallel.parallelize.tensor.plan import ResolvedPlan, parallel_style
from lightning_parallel.parallelize.tensor.split_region import PartialSumParameters

_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, *([nn.RMSNorm] if hasattr(nn, "RMSNorm") else []))


def sequence_parallel_plan(
    module: nn.Module, resolved: ResolvedPlan, tp_size: int, sequence_dim: int = 1
) -> tuple[dict, list[str]]:
    """torch ``ParallelStyle``s for every module involved, ready for ``parallelize_module``, and the regions
    (attention, MLP) whose column-wise projections all-gather their sequence-sharded input once, together
    (:class:`~lightning_parallel.parallelize.tensor.region_input.SharedRegionInput`). The trunk's ends are hooked
    by :func:`split_trunk_sequence` once the plan is applied.

    Raises:
        ValueError: If the plan splits nothing inside an ``nn.ModuleList`` of blocks, or a block's split
            layers sit directly in the block (sequence parallelism needs attention/MLP submodules).
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    experts = [fqn for fqn, style in resolved.styles.items() if style == "experts"]
    if experts:
        # The experts module reads the block's tokens whole (routing picks rows of them): it has no sequence shard.
        raise ValueError(
            f"sequence_parallel=True cannot split the grouped experts of {experts[0]} (their tokens are routed whole). "
            f"Set sequence_parallel=False, or leave the experts replicated in the plan."
        )
    modules = dict(module.named_modules())
    blocks = _trunk_blocks(modules, resolved.styles)
    sharded = Shard(sequence_dim)
    plan: dict = {}
    for fqn, style in resolved.styles.items():
        if style in ("replicate", "channelwise"):  # channelwise: split by tensor.channels, not a torch style
            continue
        inside = any(fqn.startswith(f"{block}.") for block in blocks)
        # Inside the trunk, row-wise outputs are reduce-scattered into sequence shards (only "rowwise" reads it).
        plan[fqn] = parallel_style(style, rowwise_output=sharded if inside else None, conv1d=fqn in resolved.conv1d)
    all_regions: list[str] = []
    for block in blocks:
        regions = {
            fqn.rpartition(".")[0]
            for fqn, style in resolved.styles.items()
            if style in ("colwise", "fused_qkv", "fused_gate_up", "fused_blocks") and fqn.startswith(f"{block}.")
        }
        if block in regions:
            raise ValueError(
                f"sequence_parallel=True: {block} holds its split layers directly; sequence parallelism needs them "
                f"inside attention/MLP submodules of the block. Set sequence_parallel=False."
            )
        # The gathered input stays a DTensor shared by the region's projections, so backward sums their
        # gradients first and reduce-scatters once.
        all_regions += sorted(regions)
        whole = whole_in_block(modules, resolved, block)
        for name, sub in modules[block].named_modules():
            fqn = f"{block}.{name}"
            if _is_norm(sub) and not any(fqn == w or fqn.startswith(f"{w}.") for w in whole):
                plan[fqn] = SequenceParallel(sequence_dim=sequence_dim, use_local_output=True)
    first = blocks[0]
    _check_sequence_length_on_entry(modules[first], tp_size, sequence_dim, first)
    return plan, all_regions


def split_trunk_sequence(module: nn.Module, resolved: ResolvedPlan, mesh, sequence_dim: int = 1) -> None:
    """The trunk's first block scatters its hidden states along the sequence, the last one gathers them.

    Hooks rather than torch's ``PrepareModuleInput``: blocks are often called with more positional
    inputs (GPT-2: ``block(hidden_states, cache, mask, ...)``) or with keywords only.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    modules = dict(module.named_modules())
    blocks = _trunk_blocks(modules, resolved.styles)

    def redistribute(tensor: torch.Tensor, source, target) -> torch.Tensor:
        return DTensor.from_local(tensor, mesh, [source], run_check=False).redistribute(placements=[target]).to_local()

    def scatter(_: nn.Module, args: tuple, kwargs: dict) -> tuple:
        return map_hidden_states(args, kwargs, lambda t: redistribute(t, Replicate(), Shard(sequence_dim)), blocks[0])

    def gather(_: nn.Module, __: tuple, output):
        if isinstance(output, torch.Tensor):
            return redistribute(output, Shard(sequence_dim), Replicate())
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            return type(output)([redistribute(output[0], Shard(sequence_dim), Replicate()), *output[1:]])
        raise TypeError(f"sequence_parallel=True: {blocks[-1]} returned {type(output).__name__}, not its hidden states.")

    modules[blocks[0]].register_forward_pre_hook(scatter, with_kwargs=True)
    modules[blocks[-1]].register_forward_hook(gather)

    for block in blocks:
        whole, searched = _search_block(modules, resolved, block)
        for owner in searched:
            if any(True for _ in modules[owner].parameters(recurse=False)):
                # Found by reduce_split_region_gradients from the model's root (a plain attribute: no state_dict entry).
                modules[owner]._split_region_parameters = _SequenceShardParameters(mesh, owner, modules[owner])
        for fqn in whole:
            def gather_on_entry(_: nn.Module, args: tuple, kwargs: dict, fqn: str = fqn) -> tuple:
                return map_hidden_states(args, kwargs, lambda t: redistribute(t, Shard(sequence_dim), Replicate()), fqn)

            def keep_this_ranks_part(_: nn.Module, __: tuple, output, fqn: str = fqn):
                if isinstance(output, torch.Tensor):
                    return redistribute(output, Replicate(), Shard(sequence_dim))
                if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
                    return type(output)([redistribute(output[0], Replicate(), Shard(sequence_dim)), *output[1:]])
                raise TypeError(
                    f"sequence_parallel=True: {fqn}, kept whole by the plan, returned {type(output).__name__}, not its "
                    f"hidden states (a tensor, or a tuple starting with one): its output cannot be split along the "
                    f"sequence again. Set sequence_parallel=False for this model."
                )

            modules[fqn].register_forward_pre_hook(gather_on_entry, with_kwargs=True)
            modules[fqn].register_forward_hook(keep_this_ranks_part)


def whole_in_block(modules: Mapping[str, nn.Module], resolved: ResolvedPlan, block: str) -> list[str]:
    """The modules of ``block`` that run whole on the whole sequence under sequence parallelism: children (or
    children of containers holding split modules deeper down, as BERT's ``attention``) that hold parameters, are
    no norm, and contain nothing the plan splits. A module holding split children itself (an attention, an MLP: a
    split region) is not searched: what runs beside its split projections runs on their gathered input already."""
    return _search_block(modules, resolved, block)[0]


def _search_block(modules: Mapping[str, nn.Module], resolved: ResolvedPlan, block: str) -> tuple[list[str], list[str]]:
    """(:func:`whole_in_block`, the block and the containers searched in it: their own parameters are used on this
    rank's part of the sequence, as Doge's per-feature residual scales are)."""
    split = [fqn for fqn, style in resolved.styles.items() if style != "replicate"]
    regions = {fqn.rpartition(".")[0] for fqn in split}
    whole: list[str] = []
    searched: list[str] = []

    def search(name: str) -> None:
        searched.append(name)
        for child, sub in modules[name].named_children():
            fqn = f"{name}.{child}"
            if fqn in split or _is_norm(sub):
                continue
            if any(s.startswith(f"{fqn}.") for s in split):
                if fqn not in regions:
                    search(fqn)
            elif any(True for _ in sub.parameters()):
                whole.append(fqn)

    if block not in regions:
        search(block)
    return whole, searched


class _SequenceShardParameters(PartialSumParameters):
    """The parameters a block (or a container in it) holds itself, used on this rank's part of the sequence: their
    gradients are partial sums over the group, summed by
    :func:`~lightning_parallel.parallelize.tensor.split_region.reduce_split_region_gradients` after backward."""

    def __init__(self, mesh: Any, name: str, owner: nn.Module) -> None:
        super().__init__(mesh.get_group(), name, lambda: [p for p in owner.parameters(recurse=False) if not isinstance(p, DTensor)])


def _is_norm(module: nn.Module) -> bool:
    """torch's LayerNorm/RMSNorm, or a model's own (``LlamaRMSNorm``, ``T5LayerNorm``): per-token norms."""
    return isinstance(module, _NORM_TYPES) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _trunk_blocks(modules: Mapping[str, nn.Module], styles: Mapping[str, str]) -> list[str]:
    split = [fqn for fqn, style in styles.items() if style in ("colwise", "rowwise")]
    for fqn, sub in modules.items():
        if isinstance(sub, nn.ModuleList):
            blocks = [f"{fqn}.{i}" if fqn else str(i) for i in range(len(sub))]
            if any(name.startswith(f"{block}.") for name in split for block in blocks):
                return blocks
    raise ValueError(
        "sequence_parallel=True needs the split layers inside an nn.ModuleList of blocks (the model's trunk); "
        "none was found. Set sequence_parallel=False."
    )


def _check_sequence_length_on_entry(block: nn.Module, tp_size: int, sequence_dim: int, name: str) -> None:
    def check(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if tensor is not None and tensor.size(sequence_dim) % tp_size != 0:
            raise ValueError(
                f"sequence_parallel=True: the sequence length {tensor.size(sequence_dim)} entering {name} is not "
                f"divisible by tensor_parallel_size={tp_size}. Use a multiple of {tp_size} or sequence_parallel=False."
            )

    # Registered first, so it runs before the scatter that would otherwise split unevenly.
    block.register_forward_pre_hook(check, prepend=True, with_kwargs=True)


def reduce_partial_gradients(parameters: Iterable[nn.Parameter]) -> int:
    """Give every DTensor gradient its parameter's placements, once; returns how many were changed.

    Norm weights under sequence parallelism see only their rank's tokens, so their gradients come out
    of backward as partial sums; inside traced tensor-parallel stages, DTensor's propagation may leave a
    replicated weight's gradient sharded or partial. Left so, every optimizer (and clipping) op reading
    them would communicate again, and tied weights summed over pipeline ranks would not line up; reducing
    once after the last micro-batch's backward is Megatron's single all-reduce.
    """
    from torch.distributed.tensor import DTensor, Replicate

    changed = 0
    for param in parameters:
        grad = param.grad
        if not isinstance(grad, DTensor):
            continue
        if isinstance(param, DTensor):
            target = list(param.placements)
        else:
            target = [Replicate() if p.is_partial() else p for p in grad.placements]
        if list(grad.placements) != target:
            param.grad = grad.redistribute(placements=target)
            changed += 1
    return changed
