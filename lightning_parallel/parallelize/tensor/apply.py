"""Tensor-parallel plans as data: module-name patterns mapped to sharding styles, resolved and applied.

A plan is a mapping ``{glob pattern: style name}``, writable in YAML. :func:`resolve_plan` turns it into
``{module FQN: style}`` for one concrete module (every pattern must match), :func:`infer_plan` builds one
from the module tree (Megatron-style: attention q/k/v and MLP input projections column-wise, output
projections row-wise), :func:`check_plan` validates sizes against the TP degree, and
:func:`apply_tensor_parallel` hands the plan to torch's ``parallelize_module``. The style names, the
resolved plan and each style's torch form are in :mod:`~lightning_parallel.parallelize.tensor.plan`.
No Lightning here.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from lightning_parallel.parallelize.tensor import fused as fused_layout
from lightning_parallel.parallelize.tensor.channel_recurrence import sequence_mixing_block
from lightning_parallel.parallelize.tensor.channels import check_channelwise, depthwise_channels, split_channels
from lightning_parallel.parallelize.tensor.recurrent_block import CHANNEL_WIDTH_ATTRIBUTES, blockwise_children
from lightning_parallel.parallelize.tensor.experts import check_experts, split_experts
from lightning_parallel.parallelize.tensor.gathered_input import gather_split_inputs
from lightning_parallel.parallelize.tensor.gathered_outputs import gathered
from lightning_parallel.parallelize.tensor.guards import explain_split_failures, refuse_replaced_modules
from lightning_parallel.parallelize.tensor.head_inputs import slice_per_head_inputs
from lightning_parallel.parallelize.tensor.latent import LatentRegion, latent_projections
from lightning_parallel.parallelize.tensor.multi_query import gather_key_values, is_multi_query, multi_query_attributes
from lightning_parallel.parallelize.tensor.per_head import (
    find_per_head_children,
    find_per_head_parameters,
    shard_per_head_parameters,
)
from lightning_parallel.parallelize.tensor.probe import HiddenUnitsMeetError, check_mlp_splits
from lightning_parallel.parallelize.tensor.inference import (
    grouped_qkv_heads,
    infer_plan,
    infer_units,
    is_attention_projection,
    is_grouped_qkv,
)
from lightning_parallel.parallelize.tensor.projections import (
    features,
    is_conv1d,
    is_projection,
    output_dim,
    qkv_blocks,
    qkv_heads,
    read_attribute,
)
from lightning_parallel.parallelize.tensor.region_input import SharedRegionInput
from lightning_parallel.parallelize.tensor.sequence import (
    sequence_parallel_plan,
    split_trunk_sequence,
)
from lightning_parallel.parallelize.tensor.split_region import check_split_regions, track_split_region_parameters
from lightning_parallel.parallelize.tensor.state_space import check_state_space, split_state_space
from lightning_parallel.parallelize.tensor.tied import aliases, check_tied_parameters, merge_tied_units, tie_again, tied_groups
from lightning_parallel.parallelize.tensor.wrapped import find_wrapped, see_through, split_adapters, unfollowed
from lightning_parallel.parallelize.tensor.vocabulary import (
    gather_reads_elsewhere,
    reduce_lookups_in,
    split_lookup_backward,
)
from lightning_parallel.parallelize.tensor.plan import (
    STYLE_ALIASES,
    STYLES,
    ResolvedPlan,
    parallel_style,
)

# STYLES and ResolvedPlan live in tensor_plan, so that sequence.py and stage_tensor.py use them without
# importing this module; they, and infer_plan (plan_inference), stay importable from here too (tests and callers do).
__all__ = ["STYLES", "ResolvedPlan", "TensorParallelConfig", "apply_tensor_parallel", "check_plan", "infer_plan", "resolve_plan"]

log = logging.getLogger(__name__)

#: Attribute names under which attention modules commonly keep their head counts, or widths they slice by
#: (GPT-2's ``split_size``, BERT's ``all_head_size``; never a head's own width, ``attention_head_size``);
#: found on the module or its ``config``, they are divided by the TP degree.
HEAD_ATTRIBUTES: tuple[str, ...] = (
    "n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads", "n_local_heads",
    "num_kv_heads", "split_size", "all_head_size", "n_query_groups",
)
#: Widths an attention module may keep under a name that elsewhere means the model width (XGLM's, MVP's,
#: TrOCR's ``embed_dim``, Hiera's ``hidden_size_output``, xLSTM's ``qk_dim``/``v_dim``, which they reshape the heads'
#: output by): divided only on the module itself, and only where the value is the whole output width of one of its
#: column-split q/k/v projections (for a fused q|k|v of equal blocks, of one block).
SPLIT_WIDTH_ATTRIBUTES: tuple[str, ...] = ("embed_dim", "hidden_size_output", "qk_dim", "v_dim")

@dataclass(frozen=True)
class TensorParallelConfig:
    """What to split and how.

    Args:
        plan: ``"auto"`` (inferred from the module tree by :func:`infer_plan`) or ``{glob pattern: style}``
            with styles from :data:`STYLES`; patterns are matched against names relative to the module
            the strategy trains (for a LightningModule: ``"model.blocks.*.mlp.fc_in"``).
        head_attributes: Attribute names holding head counts on attention modules; those found on the
            parent of a column-split projection are divided by the TP degree.
        sequence_parallel: Also split the residual stream of the trunk's blocks along the sequence
            (norms and dropout on 1/TP of the tokens; see :mod:`lightning_parallel.parallelize.tensor.sequence`).
    """

    plan: str | Mapping[str, str] = "auto"
    head_attributes: tuple[str, ...] = HEAD_ATTRIBUTES
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.plan, str):
            if self.plan != "auto":
                raise ValueError(f"plan={self.plan!r} is not understood: use 'auto' or a mapping {{pattern: style}}.")
        elif isinstance(self.plan, Mapping):
            for pattern, style in self.plan.items():
                if style not in STYLES:
                    raise ValueError(f"plan[{pattern!r}]: style {style!r} is unknown. Choose one of: {', '.join(STYLES)}.")
        else:
            raise TypeError(f"plan must be 'auto' or a mapping of patterns to styles, got {type(self.plan).__name__}.")
        object.__setattr__(self, "head_attributes", tuple(self.head_attributes))

    def resolve(
        self, module: nn.Module, warn: Callable[[str], None] = log.warning, tp_size: int | None = None,
        exclude: Collection[str] = (),
    ) -> ResolvedPlan:
        """The plan bound to ``module`` (inferred first when ``plan="auto"``).

        Args:
            exclude: Modules another parallelism owns (routed experts under expert parallelism): the inferred
                plan leaves them (and what is below them) out; an explicit plan naming one is refused.
            tp_size: The TP degree the plan is for. With ``plan="auto"``, an inferred group (an attention, an
                MLP) that no degree dividing it can split (a single key/value head: multi-query attention)
                stays whole, named with the reason in the printed plan (:attr:`ResolvedPlan.kept_whole`);
                one that a smaller degree could split is refused (the degree is the mistake). An explicit
                plan is checked as written by :func:`check_plan`.

        Raises:
            ValueError: ``plan="auto"``, and a group that a smaller degree than ``tp_size`` could split does
                not divide by it (:func:`check_plan`'s error).
            ValueError: ``plan="auto"`` and ``tp_size > 1``, but nothing in ``module`` can be split: training
                would be a whole copy on every rank, not tensor parallel. The error names what stays whole and why.
        """
        # Projections wrapped with adapters (peft's LoRA layers) are planned as the projections they wrap (tensor.wrapped).
        wrapped = find_wrapped(module, warn)
        with see_through(module, wrapped):
            resolved = self._resolve(module, warn, tp_size, exclude)
        refused = unfollowed(resolved.styles, wrapped)
        if refused:
            raise ValueError(
                "The tensor-parallel plan splits projections whose adapters cannot follow that split: "
                + "; ".join(f"{fqn}: {why}" for fqn, why in refused.items())
                + ". Leave them out of the adapters' target_modules, or give their module 'replicate' in an explicit plan."
            )
        return dataclasses.replace(resolved, wrapped={fqn: found for fqn, found in wrapped.items() if fqn in resolved.styles})

    def _resolve(self, module: nn.Module, warn: Callable[[str], None], tp_size: int | None, exclude: Collection[str]) -> ResolvedPlan:
        if self.plan != "auto":
            resolved = resolve_plan(module, dict(self.plan), self.head_attributes)
            owned = sorted(fqn for fqn in resolved.styles if any(fqn == o or fqn.startswith(f"{o}.") for o in exclude))
            if owned:
                raise ValueError(
                    f"The tensor-parallel plan splits {', '.join(owned)}, whose experts expert parallelism divides "
                    f"(expert_parallel_size > 1). Leave them out of the plan, or set expert_parallel_size=1."
                )
            return resolved
        sources: dict[str, str] = {}
        notes: list[str] = []

        def noted(message: str) -> None:
            notes.append(message)
            warn(message)

        units = infer_units(module, noted, sources, exclude)
        kept_whole: dict[str, str] = {}
        if self.sequence_parallel:
            # A split mixer's scan runs along the whole sequence on its rank's channels: under sequence parallelism the
            # mixers stay whole (the block gathers the sequence for what it keeps whole).
            for unit in units:
                kept_whole.update({fqn: "a state-space mixer stays whole under sequence parallelism (its scan needs the "
                                   "whole sequence)" for fqn, style in unit.items() if style == "state_space"})
            units = [unit for unit in units if "state_space" not in unit.values()]
            mixing = {id(unit): block for unit in units if (block := sequence_mixing_block(module, unit)) is not None}
            kept_whole.update({block: "it mixes each token with the previous one (a time shift): it stays whole under "
                               "sequence parallelism" for block in mixing.values()})
            units = [unit for unit in units if id(unit) not in mixing]
        whole_plan = {fqn: style for unit in units for fqn, style in unit.items()}
        if tp_size is not None and tp_size > 1 and _split_error(module, whole_plan, self.head_attributes, tp_size):
            # Some group does not divide: find which, one group at a time (most models skip this).
            kept: list[dict[str, str]] = []
            for unit in merge_tied_units(module, units):
                error = _split_error(module, unit, self.head_attributes, tp_size)
                if isinstance(error, HiddenUnitsMeetError) and gathered(unit) and not self.sequence_parallel:
                    # Its hidden units meet (a statistic over them): split with whole outputs instead (gathered_outputs;
                    # not under sequence parallelism, where its input arrives as this rank's tokens only).
                    unit = gathered(unit)
                    error = _split_error(module, unit, self.head_attributes, tp_size)
                if error is None:
                    kept.append(unit)
                elif all(_split_error(module, unit, self.head_attributes, d) for d in range(2, tp_size) if tp_size % d == 0):
                    # No degree dividing tp_size splits it (one k/v head: multi-query attention): whole, named.
                    kept_whole[_common_parent(unit)] = str(error)
                else:
                    raise error  # a smaller degree would split it: the degree chosen is what to change
            units = kept
        plan = {fqn: style for unit in units for fqn, style in unit.items()}
        resolved = resolve_plan(module, plan, self.head_attributes, sources)
        resolved = dataclasses.replace(resolved, kept_whole=kept_whole)
        if tp_size is not None and tp_size > 1 and not resolved.styles:
            reasons = [f"{fqn}: {why}" for fqn, why in kept_whole.items()] + notes
            found = "\n  ".join(reasons) if reasons else (
                "no attention, MLP, embedding or head this plan recognises (see infer_plan)")
            raise ValueError(
                f"tensor_parallel_size={tp_size} with plan='auto' splits nothing in {type(module).__name__}: every rank "
                f"would hold a whole copy. What stays whole, and why:\n  {found}\nUse data parallelism for this model, or "
                f"give TensorParallelStrategy(plan={{pattern: style}}) naming the layers to split."
            )
        return resolved


def _split_error(module: nn.Module, unit: Mapping[str, str], head_attributes: tuple[str, ...], tp_size: int) -> Exception | None:
    """Why ``unit`` (one attention, one MLP) cannot be split ``tp_size`` ways, or ``None``."""
    try:
        check_plan(module, resolve_plan(module, unit, head_attributes), tp_size)
    except (ValueError, TypeError) as error:
        return error
    return None


def _common_parent(unit: Mapping[str, str]) -> str:
    """The innermost module holding every entry of ``unit`` (an attention, an MLP), for messages."""
    if len(unit) == 1:
        return next(iter(unit))
    parts = [fqn.split(".")[:-1] for fqn in unit]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common) or next(iter(unit))


def resolve_plan(
    module: nn.Module,
    plan: Mapping[str, str],
    head_attributes: tuple[str, ...] = HEAD_ATTRIBUTES,
    sources: Mapping[str, str] | None = None,
) -> ResolvedPlan:
    """Bind a ``{pattern: style}`` plan to ``module``'s submodule names.

    Args:
        sources: Where each entry of an inferred plan came from (printed with the plan); default ``"plan"``.

    Raises:
        ValueError: A style is unknown, a pattern matches no submodule (the error lists near matches), two
            patterns give one module different styles, or a fused projection's layout is unknown.
    """
    names = [name for name, _ in module.named_modules() if name]
    known = set(names)
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"Plan entry {pattern!r}: style {style!r} is unknown. Choose one of: {', '.join(STYLES)}.")
        # An exact name (as inferred plans hold) needs no scan; a glob is matched against every name.
        exact = pattern in known and not any(c in pattern for c in "*?[")
        matched = [pattern] if exact else [name for name in names if fnmatchcase(name, pattern)]
        if not matched:
            near = difflib.get_close_matches(pattern, names, n=5, cutoff=0.5)
            hint = f" Near matches: {', '.join(near)}." if near else ""
            raise ValueError(f"Plan pattern {pattern!r} matches no submodule of {type(module).__name__}.{hint}")
        style = STYLE_ALIASES.get(style, style)
        for name in matched:
            if styles.get(name, style) != style:
                raise ValueError(f"Module {name!r} is matched with two styles: {styles[name]!r} and {style!r} (from {pattern!r}).")
            styles[name] = style
    modules = dict(module.named_modules())
    fused: dict[str, tuple[int, ...]] = {}
    heads: dict[str, tuple[int, int]] = {}
    multi_query: set[str] = set()  # fused q|k|v with one k/v head: queries split, k/v gathered (multi_query.py)
    for fqn, style in styles.items():
        parent, _, child = fqn.rpartition(".")
        if style == "fused_qkv":
            fused[fqn] = qkv_blocks(fqn, modules[fqn], modules.get(parent))
            heads[fqn] = qkv_heads(fqn, modules[fqn], modules.get(parent))
            if is_multi_query(heads[fqn]):
                multi_query.add(fqn)
        elif style == "colwise" and is_grouped_qkv(child) and is_projection(modules[fqn]):
            # Laid out per key/value group: a column split must give each rank whole groups.
            grouped = grouped_qkv_heads(modules.get(parent), modules[fqn])
            if grouped is not None:
                heads[fqn] = grouped
        elif style == "fused_gate_up":
            out = features(modules[fqn])[1] if is_projection(modules[fqn]) else 0
            fused[fqn] = (out // 2, out // 2)
        elif style == "fused_blocks":
            fused[fqn] = _equal_blocks(fqn, modules, styles)
    head_attrs = _attention_heads(modules, styles, head_attributes)
    for fqn in multi_query:
        parent = fqn.rpartition(".")[0]
        if parent in head_attrs:
            head_attrs[parent] = multi_query_attributes(modules[parent], head_attrs[parent], fused[fqn][0], heads[fqn][0])
    per_head = {}
    for fqn in list(head_attrs):
        split_children = [f for f, s in styles.items() if f.rpartition(".")[0] == fqn and s in ("colwise", "fused_qkv")]
        if any(styles[f] == "fused_qkv" or is_attention_projection(f.rpartition(".")[2]) for f in split_children):
            names = find_per_head_parameters(modules[fqn], fqn)
            if names:
                per_head[fqn] = names
            children = find_per_head_children(modules[fqn], fqn)
            for child, (params, counts) in children.items():
                per_head[child] = params
            head_attrs.update({child: counts for child, (_, counts) in children.items()})
    for fqn, style in styles.items():
        if style == "channelwise" and depthwise_channels(modules[fqn]) is not None:
            # A gated recurrence's blockwise children and channel widths (tensor.recurrent_block).
            parent = fqn.rpartition(".")[0]
            channels = depthwise_channels(modules[fqn])
            children = blockwise_children(modules[parent], channels, f"{parent}." if parent else "")
            per_head.update({child: params for child, (params, _) in children.items()})
            head_attrs.update({child: counts for child, (_, counts) in children.items()})
            widths = tuple(a for a in CHANNEL_WIDTH_ATTRIBUTES if getattr(modules[parent], a, None) == channels)
            if widths:
                head_attrs[parent] = tuple(dict.fromkeys(head_attrs.get(parent, ()) + widths))
    return ResolvedPlan(
        styles=styles,
        head_attributes=head_attrs,
        per_head=per_head,
        latent=latent_projections(modules, styles),
        fused=fused,
        sources={fqn: (sources or {}).get(fqn, "plan") for fqn in styles},
        conv1d=frozenset(fqn for fqn in styles if is_conv1d(modules[fqn])),
        heads=heads,
        multi_query=frozenset(multi_query),
    )


#: Styles that split a projection's output features (its input is whole on every rank).
COLUMN_STYLES = ("colwise", "colwise_gather_output", "fused_qkv", "fused_gate_up", "fused_blocks", "loss_parallel")
_PROJECTION_STYLES = (*COLUMN_STYLES, "rowwise", "colwise_gather_input")


def check_plan(module: nn.Module, resolved: ResolvedPlan, tp_size: int) -> None:
    """Check that every split dimension, fused block and head count divides by ``tp_size``.

    Raises:
        ValueError: Naming the module, the size and the TP degree.
        TypeError: A style is applied to a module type it does not fit.
    """
    with see_through(module, resolved.wrapped):
        _check_plan(module, resolved, tp_size)


def _check_plan(module: nn.Module, resolved: ResolvedPlan, tp_size: int) -> None:
    modules = dict(module.named_modules())
    for fqn, style in resolved.styles.items():
        sub = modules[fqn]
        if style in _PROJECTION_STYLES:
            if not is_projection(sub) or (style == "loss_parallel" and not isinstance(sub, nn.Linear)):
                needs = "an nn.Linear" if style == "loss_parallel" else "an nn.Linear or a transformers Conv1D"
                subclass = " (an nn.Linear subclass whose forward computes more than x·Wᵀ+b)" if isinstance(sub, nn.Linear) else ""
                raise TypeError(f"{fqn}: style {style!r} needs {needs}, got {type(sub).__name__}{subclass}.")
            in_features, out_features = features(sub)
            dim_name, size = ("in_features", in_features) if style == "rowwise" else ("out_features", out_features)
            _require_divisible(fqn, dim_name, size, tp_size)
        elif style == "experts":
            check_experts(fqn, sub, tp_size)
        elif style == "state_space":
            check_state_space(fqn, sub, tp_size)
        elif style == "channelwise":
            check_channelwise(fqn, sub, tp_size)
            _require_region_around(fqn, modules, resolved)
        elif style == "embedding_rowwise":
            if not isinstance(sub, nn.Embedding):
                raise TypeError(f"{fqn}: style 'embedding_rowwise' needs an nn.Embedding, got {type(sub).__name__}.")
            others = [name for name, _ in sub.named_parameters() if name != "weight"]
            if others:
                raise TypeError(
                    f"{fqn}: style 'embedding_rowwise' splits an nn.Embedding's weight, but {type(sub).__name__} also "
                    f"holds {', '.join(others)} (a norm or scale of its own), which torch's split cannot place. Leave "
                    f"{fqn} replicated in the plan."
                )
            _require_divisible(fqn, "num_embeddings", sub.num_embeddings, tp_size)
    for fqn, blocks in resolved.fused.items():
        style = resolved.styles[fqn]
        names = ("q", "k", "v") if style == "fused_qkv" else ("gate", "up") if style == "fused_gate_up" else (
            tuple(f"block {i}" for i in range(len(blocks))))
        for name, size in zip(names, blocks):
            _require_divisible(fqn, f"{name} block", size, tp_size)
    for fqn, (heads, kv_heads) in resolved.heads.items():
        for what, count in (("query heads", heads), ("key/value heads", kv_heads)):
            if count % tp_size and not (fqn in resolved.multi_query and what.startswith("key")):
                mqa = " (multi-query attention: one k/v head for all queries)" if kv_heads == 1 and what.startswith("key") else ""
                raise ValueError(
                    f"{fqn}: its {count} {what}{mqa} cannot be divided among tensor_parallel_size={tp_size} ranks: each "
                    f"rank must hold whole heads of q, k and v from one fused matrix. Choose a tensor_parallel_size that "
                    f"divides {count}, or leave {fqn.rpartition('.')[0] or fqn} replicated in the plan."
                )
    for fqn, attrs in resolved.head_attributes.items():
        for attr in attrs:
            _require_divisible(fqn, attr, _get_attribute(modules[fqn], attr), tp_size)
    for fqn, names in resolved.per_head.items():
        for name in names:
            _require_divisible(fqn, f"{name}.shape[0] (one per head)", getattr(modules[fqn], name).shape[0], tp_size)
    check_split_regions(module, resolved, tp_size)
    for fqn, style in resolved.styles.items():
        if style == "rowwise":
            _require_split_input(fqn, modules, resolved)
    check_tied_parameters(module, resolved)
    check_mlp_splits(module, resolved, tp_size)


def apply_tensor_parallel(module: nn.Module, tp_mesh, resolved: ResolvedPlan, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``module`` in place over the 1-D ``tp_mesh`` and shrink its attention head counts.

    Call :func:`check_plan` first; this assumes the sizes divide. Projections wrapped with adapters split as the
    unwrapped model's, their adapters with them (:mod:`~lightning_parallel.parallelize.tensor.wrapped`).
    """
    with see_through(module, resolved.wrapped):
        _apply_tensor_parallel(module, tp_mesh, resolved, sequence_parallel)
    split_adapters(module, resolved.styles, resolved.wrapped, tp_mesh, parallel_style)
    return module


def _apply_tensor_parallel(module: nn.Module, tp_mesh, resolved: ResolvedPlan, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    tp_size = tp_mesh.size()
    modules = dict(module.named_modules())
    if sequence_parallel and resolved.latent:
        region = next(iter(resolved.latent))
        raise ValueError(
            f"sequence_parallel=True: {region} keeps its latent projections ({', '.join(resolved.latent[region])}) "
            f"replicated beside its split heads, which runs on the whole sequence only. Set sequence_parallel=False "
            f"for this model, or leave {region} replicated in the plan."
        )
    mixers = [fqn for fqn, style in resolved.styles.items() if style == "state_space"]
    if sequence_parallel and mixers:
        raise ValueError(
            f"sequence_parallel=True: {mixers[0]} is a state-space mixer split over its channels ('state_space'), whose "
            f"scan runs along the whole sequence on each rank's channels. Set sequence_parallel=False, or leave the "
            f"mixers replicated in the plan (plan='auto' with sequence_parallel=True does)."
        )
    if sequence_parallel:
        torch_plan, regions = sequence_parallel_plan(module, resolved, tp_size)
        arrives_as = Shard(1)
    else:
        torch_plan = {
            fqn: parallel_style(style, conv1d=fqn in resolved.conv1d)
            for fqn, style in resolved.styles.items()
            if style not in ("replicate", "experts", "channelwise", "state_space")
        }
        # Where several column-wise projections read one input (q/k/v, gated MLPs), they get one shared
        # replicated DTensor: their input gradients add up as one partial sum, one all-reduce.
        regions, arrives_as = shared_input_regions(resolved), Replicate()
    for region in regions:
        projections = [modules[fqn] for fqn, style in resolved.styles.items() if style in COLUMN_STYLES and fqn.rpartition(".")[0] == region]
        SharedRegionInput(tp_mesh, arrives_as).attach(modules[region], projections, region)
    layouts = _order_fused_rank_major(modules, resolved, tp_size)
    split = {fqn for fqn, style in resolved.styles.items() if style != "replicate"}
    tied = [holders for holders in tied_groups(module) if {fqn for fqn, _ in holders} - aliases(holders, split) <= split
            and any(fqn in split for fqn, _ in holders)]
    parallelize_module(module, tp_mesh, torch_plan)
    gather_key_values(modules, resolved.fused, resolved.multi_query, tp_mesh)
    gather_split_inputs(modules, resolved.styles, tp_mesh)
    tie_again(module, tied)
    split_channels(modules, resolved.styles, tp_mesh)
    def ancestors(fqn: str) -> list[nn.Module]:
        return [modules[".".join(fqn.split(".")[:i])] for i in range(fqn.count(".") + 1)]

    vocabulary_split = {fqn for fqn, style in resolved.styles.items() if style == "embedding_rowwise"}
    for fqn in vocabulary_split:
        reduce_lookups_in(modules[fqn])  # an embedding that scales its rows (Gemma) loses the lookup's mask
        split_lookup_backward(modules[fqn])  # torch's backward computes the whole table's gradient
        gather_reads_elsewhere(fqn, modules[fqn], ancestors(fqn), log.warning)
    # A head tied to a vocabulary-split table may be read, not called, by the model's code (MobileBERT's prediction
    # head multiplies by torch.cat([decoder.weight.t(), dense.weight])): it gets the whole weight the same way.
    for holders in tied:
        if any(fqn in vocabulary_split for fqn, _ in holders):
            for fqn, name in holders:
                if fqn not in vocabulary_split and name == "weight" and fqn in modules:
                    gather_reads_elsewhere(fqn, modules[fqn], ancestors(fqn), log.warning)
    for fqn, style in resolved.styles.items():
        if style == "experts":
            experts_layouts = split_experts(fqn, modules[fqn], check_experts(fqn, modules[fqn], tp_size), tp_mesh)
            if experts_layouts:
                layouts[fqn] = experts_layouts
        elif style == "state_space":
            layouts.update(split_state_space(fqn, modules[fqn], check_state_space(fqn, modules[fqn], tp_size), tp_mesh))
    if sequence_parallel:
        split_trunk_sequence(module, resolved, tp_mesh)
    for fqn, parameter_layouts in layouts.items():
        fused_layout.mark(modules[fqn], parameter_layouts)
    for fqn, style in resolved.styles.items():
        if style == "loss_parallel":
            modules[fqn].register_forward_hook(_whole_logits_in_eval)
        elif style in ("rowwise", "embedding_rowwise") or (style in COLUMN_STYLES and _beside_in_place(modules, fqn)):
            modules[fqn].register_forward_hook(_output_of_its_own)
    slice_per_head_inputs(modules, resolved, tp_mesh)
    shard_per_head_parameters(modules, resolved.per_head, tp_mesh)
    for region, latent in resolved.latent.items():
        split = {fqn.rpartition(".")[2] for fqn in resolved.styles if fqn.rpartition(".")[0] == region}
        columns = [modules[fqn] for fqn, style in resolved.styles.items() if style in COLUMN_STYLES and fqn.rpartition(".")[0] == region]
        LatentRegion(tp_mesh, region).attach(modules[region], columns, split, resolved.per_head.get(region, ()))
    # Replicated parameters used on this rank's slice (per-head norms) are found in forward; their gradients are
    # summed over the group after backward (split_region.reduce_split_region_gradients, called by the strategy).
    track_split_region_parameters(modules, resolved, tp_mesh)
    _divide_head_attributes(modules, resolved, tp_size)
    # Attention modules computing with sizes the plan did not divide stop with what and why, not deep in torch.
    attentions = {fqn: [f for f, s in resolved.styles.items() if f.rpartition(".")[0] == fqn and s in COLUMN_STYLES]
                  for fqn in resolved.head_attributes}
    explain_split_failures(modules, list(attentions))
    refuse_replaced_modules(module, modules, attentions)


def _order_fused_rank_major(
    modules: Mapping[str, nn.Module], resolved: ResolvedPlan, tp_size: int
) -> dict[str, dict[str, fused_layout.FusedLayout]]:
    """Reorder each fused projection's rows rank-major (before sharding); returns their layouts by module."""
    layouts: dict[str, dict[str, fused_layout.FusedLayout]] = {}
    reordered: set[int] = set()
    for fqn, blocks in resolved.fused.items():
        sub = modules[fqn]
        layouts[fqn] = {}
        for name, param in sub.named_parameters(recurse=False):
            layout = fused_layout.FusedLayout(output_dim(sub, name), tuple(blocks), tp_size)
            if id(param) not in reordered:  # a tensor tied across depths (Zamba2's shared block) is reordered once
                reordered.add(id(param))
                fused_layout.rank_major_rows(param, layout)
            layouts[fqn][name] = layout
    return layouts


def _divide_head_attributes(modules: Mapping[str, nn.Module], resolved: ResolvedPlan, tp_size: int) -> None:
    """Each rank now holds 1/tp of the heads: the counts (and widths) the module reshapes by shrink."""
    for fqn, attrs in resolved.head_attributes.items():
        sub = modules[fqn]
        if any(attr.startswith("config.") for attr in attrs):
            # A copy: the config object is shared with the rest of the model (embeddings, other layers' use).
            sub.config = copy.copy(sub.config)
        # Read every count before setting any: config attributes may alias each other (n_head, num_attention_heads).
        counts = {attr: _get_attribute(sub, attr) for attr in attrs}
        for attr, count in counts.items():
            owner, name = (sub.config, attr.removeprefix("config.")) if attr.startswith("config.") else (sub, attr)
            setattr(owner, name, count // tp_size)


def _get_attribute(module: nn.Module, attr: str) -> int:
    return getattr(module.config, attr.removeprefix("config.")) if attr.startswith("config.") else getattr(module, attr)


def _beside_in_place(modules: Mapping[str, nn.Module], fqn: str) -> bool:
    """A sibling of ``fqn`` works in place (``nn.ReLU(inplace=True)`` after a column-split projection, as in Swin-V2's
    position-bias MLP): the projection's output must then be a tensor of its own (see :func:`_output_of_its_own`)."""
    parent = modules.get(fqn.rpartition(".")[0])
    return parent is not None and any(getattr(child, "inplace", False) is True for child in parent.children())


def _output_of_its_own(module: nn.Module, inputs: tuple, output):
    # DTensor.to_local() hands out a view made inside an autograd Function; a model that adds to the
    # output in place (Falcon: ``mlp_output += attention_output``) would be refused by autograd. A copy
    # (of an activation, next to the all-reduce that made it) makes it an ordinary tensor.
    from torch import Tensor
    from torch.distributed.tensor import DTensor

    if isinstance(output, Tensor) and not isinstance(output, DTensor):
        return output.clone()
    return output


def _whole_logits_in_eval(module: nn.Module, inputs: tuple, output):
    # Outside training (validation, test, predict: eval mode) users get ordinary logits back.
    from torch.distributed.tensor import DTensor

    if not module.training and isinstance(output, DTensor):
        return output.full_tensor()
    return output


def shared_input_regions(resolved: ResolvedPlan) -> list[str]:
    """Modules holding two or more column-wise projections (they read the same input)."""
    parents: dict[str, int] = {}
    for fqn, style in resolved.styles.items():
        if style in ("colwise", "fused_qkv", "fused_gate_up", "fused_blocks"):
            parent = fqn.rpartition(".")[0]
            parents[parent] = parents.get(parent, 0) + 1
    return [parent for parent, count in parents.items() if count > 1 and parent]


def _attention_heads(modules: Mapping[str, nn.Module], styles: Mapping[str, str], attributes: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Parents of column-split projections that keep an integer head count: those counts shrink per rank.

    Counts on the module itself always; on its ``config`` (``config.num_attention_heads``) only for attention
    modules (a split q/k/v projection), which is where Hugging Face layers read them.
    """
    found: dict[str, tuple[str, ...]] = {}
    for fqn, style in styles.items():
        if style not in ("colwise", "fused_qkv"):
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = modules.get(parent_name)
        attrs = [a for a in attributes if _is_count(read_attribute(parent, a))]
        config = getattr(parent, "config", None)
        if config is not None and (style == "fused_qkv" or is_attention_projection(child)):
            attrs += [f"config.{a}" for a in attributes if _is_count(read_attribute(config, a))]
        if (style == "fused_qkv" or is_attention_projection(child)) and is_projection(modules[fqn]):
            width = features(modules[fqn])[1]
            widths = {width, width // 3} if style == "fused_qkv" and width % 3 == 0 else {width}
            attrs += [a for a in SPLIT_WIDTH_ATTRIBUTES if _is_count(getattr(parent, a, None)) and getattr(parent, a) in widths]
        if attrs:
            found[parent_name] = tuple(dict.fromkeys(found.get(parent_name, ()) + tuple(attrs)))
    return found


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_split_input(fqn: str, modules: Mapping[str, nn.Module], resolved: ResolvedPlan) -> None:
    """A row-wise projection reads its input split over the ranks: something column-split must produce it, in
    its own module (attention, MLP) or in a sibling module (BERT's ``intermediate.dense`` → ``output.dense``)."""
    parent = fqn.rpartition(".")[0]
    grandparent = parent.rpartition(".")[0] if parent else None
    for other, style in resolved.styles.items():
        if style not in ("colwise", "fused_qkv", "fused_gate_up", "fused_blocks"):  # gathered or loss-parallel outputs are no split input
            continue
        owner = other.rpartition(".")[0]
        if owner == parent or (parent and owner and owner.rpartition(".")[0] == grandparent):
            return
    where = parent or "the model"
    raise ValueError(
        f"{fqn}: style 'rowwise' reads its input split over the ranks, but nothing in {where} (or beside it) is split "
        f"column-wise, so its input is whole on every rank. Give it a column-wise partner in the plan, or leave {fqn} "
        f"replicated."
    )


def _equal_blocks(fqn: str, modules: Mapping[str, nn.Module], styles: Mapping[str, str]) -> tuple[int, ...]:
    """Blocks of a ``fused_blocks`` projection: as wide as the input of the row-wise projection beside it (the one
    that closes its region reads one block's width: a short convolution's ``out_proj`` reads ``B·C·x``'s width).

    Raises:
        TypeError: ``fqn`` is not a projection.
        ValueError: No single row-wise projection beside it, or its width is not a whole number of such blocks.
    """
    sub = modules[fqn]
    if not is_projection(sub):
        raise TypeError(f"{fqn}: style 'fused_blocks' needs an nn.Linear or a transformers Conv1D, got {type(sub).__name__}.")
    parent = fqn.rpartition(".")[0]
    widths = {features(modules[other])[0] for other, style in styles.items()
              if style == "rowwise" and other.rpartition(".")[0] == parent and is_projection(modules[other])}
    out = features(sub)[1]
    if len(widths) != 1 or out % next(iter(widths)):
        found = f"row-wise projections reading {'/'.join(map(str, sorted(widths)))} features" if widths else "no row-wise projection"
        raise ValueError(
            f"{fqn}: style 'fused_blocks' cuts its {out} output features into blocks as wide as the input of the one "
            f"row-wise projection beside it in {parent or 'the model'}, but found {found}. Give that projection "
            f"'rowwise' in the plan, or split {fqn} with another style."
        )
    width = next(iter(widths))
    return (width,) * (out // width)


def _require_region_around(fqn: str, modules: Mapping[str, nn.Module], resolved: ResolvedPlan) -> None:
    """A ``channelwise`` convolution computes on a rank's channels: a column-wise projection beside it must hand
    it those channels and a row-wise one take them back, both as wide as its channels."""
    parent = fqn.rpartition(".")[0]
    channels = modules[fqn].groups
    beside = {other: style for other, style in resolved.styles.items() if other.rpartition(".")[0] == parent and other != fqn}
    opens = [o for o, s in beside.items() if s in ("colwise", "fused_blocks") and is_projection(modules[o])
             and channels in {features(modules[o])[1], *resolved.fused.get(o, ())}]
    closes = [o for o, s in beside.items() if s == "rowwise" and is_projection(modules[o]) and features(modules[o])[0] == channels]
    if not opens or not closes:
        raise ValueError(
            f"{fqn}: style 'channelwise' runs the convolution on a rank's {channels} channels, which a column-wise "
            f"projection beside it in {parent or 'the model'} must produce and a row-wise one read back; found "
            f"{'no column-wise' if not opens else 'no row-wise'} projection of that width there. Split the projections "
            f"around it too, or leave {fqn} replicated in the plan."
        )


def _require_divisible(fqn: str, what: str, size: int, tp_size: int) -> None:
    if size % tp_size != 0:
        raise ValueError(
            f"{fqn}.{what}={size} is not divisible by tensor_parallel_size={tp_size}. "
            f"Choose a tensor_parallel_size that divides {size}, or leave {fqn} replicated in the plan."
        )
