"""Tied weights under tensor parallelism: one tensor held by several modules (a tied embedding and head).

Such a tensor may be split only where every holder splits it the same way: by rows, or by one style on every holder
(a block whose weights are used at several depths) (:func:`check_tied_parameters`); after torch's ``parallelize_module`` gave each holder its own DTensor,
:func:`tie_again` points them all at one. No Lightning here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from lightning_parallel.parallelize.tensor.plan import ResolvedPlan


#: Styles that split a module's ``weight`` along its first dimension (an embedding's vocabulary rows, a Linear's
#: output features): one tensor tied between modules of these styles is the same shard on every holder.
#: ``loss_parallel`` would too, but hands training_step sharded logits; with a tied head it is untested: refused.
_ROW_SHARDED_WEIGHT = ("embedding_rowwise", "colwise", "colwise_gather_output")


def tied_groups(module: nn.Module) -> list[list[tuple[str, str]]]:
    """``(module FQN, parameter name)`` of each tensor that several modules hold (tied weights)."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for fqn, sub in module.named_modules(remove_duplicate=False):
        for pname, param in sub.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((fqn, pname))
    return [holders for holders in owners.values() if len({fqn for fqn, _ in holders}) > 1]


def aliases(holders: list[tuple[str, str]], split: set[str]) -> set[str]:
    """Holders of a tied tensor that are ancestors of a split holder (BERT's LM head keeps ``cls.predictions.bias``,
    the very tensor of its ``decoder.bias``): they hold it beside the module computing with it, and follow its split."""
    splitting = {fqn for fqn, _ in holders if fqn in split}
    return {fqn for fqn, _ in holders if fqn not in split and any(s.startswith(f"{fqn}.") or not fqn for s in splitting)}


def merge_tied_units(module: nn.Module, units: list[dict[str, str]]) -> list[dict[str, str]]:
    """``units`` (groups split whole or not at all), those holding one tied tensor merged: a block whose weights are
    used at several depths is split at every depth or at none."""
    unit_of: dict[str, int] = {}
    for index, unit in enumerate(units):
        for fqn in unit:
            unit_of[fqn] = index
    parent = list(range(len(units)))

    def root(index: int) -> int:
        while parent[index] != index:
            index = parent[index]
        return index

    for holders in tied_groups(module):
        indices = {unit_of[fqn] for fqn, _ in holders if fqn in unit_of}
        first, *rest = sorted(map(root, indices)) or [None]
        for other in rest:
            parent[other] = first
    merged: dict[int, dict[str, str]] = {}
    for index, unit in enumerate(units):
        merged.setdefault(root(index), {}).update(unit)
    return list(merged.values())


def check_tied_parameters(module: nn.Module, resolved: ResolvedPlan) -> None:
    """A tied tensor is split only where every module holding it splits it the same way (its rows), or holds it as
    an ancestor of such a module (:func:`aliases`)."""
    split = {fqn for fqn, style in resolved.styles.items() if style != "replicate"}
    for holders in tied_groups(module):
        modules_of = {fqn for fqn, _ in holders}
        if not modules_of & split:
            continue
        alias = aliases(holders, split)
        # Column-split projections shard their bias by rows too (Shard(0)), an embedding has none.
        same_rows = modules_of - alias <= split and all(
            (pname == "weight" or (pname == "bias" and resolved.styles[fqn] != "embedding_rowwise"))
            and resolved.styles[fqn] in _ROW_SHARDED_WEIGHT and fqn not in resolved.conv1d
            for fqn, pname in holders if fqn not in alias
        )
        if not same_rows and not _same_split(holders, alias, split, resolved):
            names = ", ".join(f"{fqn}.{pname}" if fqn else pname for fqn, pname in holders)
            styles = ", ".join(f"{fqn}: {resolved.styles.get(fqn, 'replicated')}" for fqn in sorted(modules_of))
            raise ValueError(
                f"Parameters {names} are tied (one tensor), but the plan does not split it the same way in every "
                f"module holding it ({styles}). Split them all by rows (an embedding 'embedding_rowwise' with its "
                f"head 'colwise_gather_output'), leave all of them replicated, or untie the weights."
            )


#: Styles whose split of a module's parameters depends only on the module's own shapes (and the plan's recorded blocks
#: and heads): two modules holding one tensor and split by the same entry hold the same shard of it.
_SAME_SPLIT_STYLES = ("colwise", "rowwise", "colwise_gather_output", "fused_qkv", "fused_gate_up", "fused_blocks")


def _same_split(holders: list[tuple[str, str]], alias: set[str], split: set[str], resolved: ResolvedPlan) -> bool:
    """Every holder of a tied tensor splits it the same way: one module's weights used at several depths (Zamba's and
    Zamba2's shared transformer block, one set of tensors in each hybrid layer) split once, consistently, for all uses."""
    own = [(fqn, pname) for fqn, pname in holders if fqn not in alias]
    if not {fqn for fqn, _ in own} <= split:
        return False
    ways = {(resolved.styles[fqn], pname, fqn in resolved.conv1d, resolved.fused.get(fqn), resolved.heads.get(fqn),
             fqn in resolved.multi_query) for fqn, pname in own}
    return len(ways) == 1 and next(iter(ways))[0] in _SAME_SPLIT_STYLES


def tie_again(module: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """Point every holder of a tied tensor at the first holder's sharded parameter.

    ``parallelize_module`` distributes each module's parameters on their own, so a tied embedding and head come
    out as two DTensors of equal values; training must update one (as on one device, where the gradient of both
    uses adds up in the one tensor).
    """
    from torch.distributed.tensor import DTensor

    for holders in groups:
        # The first sharded holder's parameter (an ancestor holding it as an alias still has the whole tensor).
        first, first_name = next(((f, p) for f, p in holders if isinstance(module.get_submodule(f).get_parameter(p), DTensor)),
                                 holders[0])
        shared = module.get_submodule(first).get_parameter(first_name)
        for fqn, pname in holders:
            if (fqn, pname) == (first, first_name):
                continue
            own = module.get_submodule(fqn).get_parameter(pname)
            if isinstance(own, DTensor) and own.placements != shared.placements:
                raise RuntimeError(
                    f"{first}.{first_name} and {fqn}.{pname} are tied but were sharded as {shared.placements} and "
                    f"{own.placements}; the plan must split every holder of a tied tensor the same way."
                )
            module.get_submodule(fqn).register_parameter(pname, shared)
