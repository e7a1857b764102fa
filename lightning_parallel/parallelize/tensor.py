"""Tensor-parallel plans as data: module-name patterns mapped to sharding styles, resolved and applied.

A plan is a mapping ``{glob pattern: style name}``, writable in YAML. :func:`resolve_plan` turns it into
``{module FQN: style}`` for one concrete module (every pattern must match), :func:`infer_plan` builds one
from the module tree (Megatron-style: attention q/k/v and MLP input projections column-wise, output
projections row-wise), :func:`check_plan` validates sizes against the TP degree, and
:func:`apply_tensor_parallel` hands the plan to torch's ``parallelize_module``. The style names, the
resolved plan and each style's torch form are in :mod:`~lightning_parallel.parallelize.tensor_plan`.
No Lightning here.
"""

from __future__ import annotations

import copy
import difflib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from lightning_parallel.parallelize import fused as fused_layout
from lightning_parallel.parallelize.projections import (
    QUERY_HEADS,
    features,
    head_count,
    is_conv1d,
    is_projection,
    output_dim,
    qkv_blocks,
)
from lightning_parallel.parallelize.published_plan import published_plan
from lightning_parallel.parallelize.region_input import SharedRegionInput
from lightning_parallel.parallelize.sequence import (
    sequence_parallel_plan,
    split_trunk_sequence,
)
from lightning_parallel.parallelize.tensor_plan import (
    STYLE_ALIASES,
    STYLES,
    ResolvedPlan,
    parallel_style,
)

# STYLES and ResolvedPlan live in tensor_plan, so that sequence.py and stage_tensor.py use them without
# importing this module; they stay importable from here too (tests and callers do).

log = logging.getLogger(__name__)

#: Attribute names under which attention modules commonly keep their head counts, or widths they slice by
#: (GPT-2's ``split_size``); found on the module or its ``config``, they are divided by the TP degree.
HEAD_ATTRIBUTES: tuple[str, ...] = (
    "n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads", "n_local_heads",
    "num_kv_heads", "split_size",
)

# Attention projections by conventional names: (query, key, value, output).
_ATTENTION_NAMES: tuple[tuple[str, str, str, str], ...] = (
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("q_proj", "k_proj", "v_proj", "out_proj"),
    ("wq", "wk", "wv", "wo"),
    ("query", "key", "value", "out"),
    ("query", "key", "value", "dense"),
    ("to_q", "to_k", "to_v", "to_out"),
)
# Fused projections laid out as concatenated blocks q | k | v (GQA: k and v narrower), and their output projections.
_FUSED_QKV_NAMES = ("qkv", "c_attn", "wqkv", "qkv_proj")
_ATTENTION_OUTPUT_NAMES = ("o_proj", "c_proj", "out_proj", "dense", "wo", "proj", "out")
# Fused q/k/v whose layout differs between families (per-head interleaved in GPT-NeoX and Bloom, blocks in
# others): split only as the model's own published plan says.
_AMBIGUOUS_QKV_NAMES = ("query_key_value",)
# Fused gate | up projections of gated MLPs, and their output projections.
_FUSED_GATE_UP_NAMES = ("gate_up_proj",)
_MLP_OUTPUT_NAMES = ("down_proj", "c_proj", "fc2", "w2", "wo")


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
            (norms and dropout on 1/TP of the tokens; see :mod:`lightning_parallel.parallelize.sequence`).
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

    def resolve(self, module: nn.Module, warn: Callable[[str], None] = log.warning) -> ResolvedPlan:
        """The plan bound to ``module`` (inferred first when ``plan="auto"``)."""
        if self.plan != "auto":
            return resolve_plan(module, dict(self.plan), self.head_attributes)
        sources: dict[str, str] = {}
        return resolve_plan(module, infer_plan(module, warn, sources), self.head_attributes, sources)


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
    styles: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"Plan entry {pattern!r}: style {style!r} is unknown. Choose one of: {', '.join(STYLES)}.")
        matched = [name for name in names if fnmatchcase(name, pattern)]
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
    for fqn, style in styles.items():
        if style == "fused_qkv":
            fused[fqn] = qkv_blocks(fqn, modules[fqn], modules.get(fqn.rpartition(".")[0]))
        elif style == "fused_gate_up":
            out = features(modules[fqn])[1] if is_projection(modules[fqn]) else 0
            fused[fqn] = (out // 2, out // 2)
    return ResolvedPlan(
        styles=styles,
        head_attributes=_attention_heads(modules, styles, head_attributes),
        fused=fused,
        sources={fqn: (sources or {}).get(fqn, "plan") for fqn in styles},
        conv1d=frozenset(fqn for fqn in styles if is_conv1d(modules[fqn])),
    )


def infer_plan(
    module: nn.Module, warn: Callable[[str], None] = log.warning, sources: dict[str, str] | None = None
) -> dict[str, str]:
    """Build a Megatron-style plan from the module tree; returns ``{FQN: style}`` (an exact-name plan).

    - attention with separate q/k/v/output projections (conventional names): q/k/v column-wise, output row-wise;
    - fused q|k|v projections (``qkv_proj``, GPT-2's ``c_attn``, ...): split by blocks and whole heads
      (``fused_qkv``), output row-wise; fused ``gate_up_proj``: ``fused_gate_up``, ``down_proj`` row-wise;
    - MLPs, recognised by shape among a module's direct projections: ``d→h, h→d`` (first column-wise,
      second row-wise) and gated ``d→h, d→h, h→d`` (SwiGLU: the two inputs column-wise);
    - projections are ``nn.Linear`` or transformers' ``Conv1D``;
    - a Hugging Face model's own published plan (its ``_tp_plan``) fills in what the above leaves out:
      the layout of ``query_key_value``, the embedding and an untied output head (tied weights stay whole);
    - ``nn.MultiheadAttention`` and fused projections of unknown layout stay replicated, with a warning.

    Args:
        sources: Filled with where each entry came from (``"inferred"`` or ``"model's tp_plan"``).
    """
    sources = sources if sources is not None else {}
    published = published_plan(module)
    plan: dict[str, str] = {}
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(sub, nn.MultiheadAttention):
            warn(f"{name or type(sub).__name__}: nn.MultiheadAttention keeps q/k/v fused inside; left replicated.")
            continue
        projections = {child: m for child, m in sub.named_children() if is_projection(m)}
        plan.update({f"{prefix}{child}": style for child, style in _match_block(sub, prefix, projections, published, warn).items()})
    tied = _tied_modules(module)
    for fqn, style in published.items():
        if fqn in plan or any(fqn.startswith(f"{done}.") for done in plan):
            continue
        if fqn in tied:
            continue  # tied to another module's weight (an embedding and its head): kept whole
        plan[fqn] = style
        sources[fqn] = "model's tp_plan"
    for fqn in plan:
        sources.setdefault(fqn, "inferred")
    return plan


def _match_block(
    sub: nn.Module, prefix: str, projections: Mapping[str, nn.Module], published: Mapping[str, str], warn: Callable[[str], None]
) -> dict[str, str]:
    """Styles for one module's direct projections (attention, fused attention, MLP), or ``{}``."""
    lowered = {child.lower(): child for child in projections}
    qkv = next((lowered[n] for n in _FUSED_QKV_NAMES if n in lowered), None)
    ambiguous = next((lowered[n] for n in _AMBIGUOUS_QKV_NAMES if n in lowered), None)
    gate_up = next((lowered[n] for n in _FUSED_GATE_UP_NAMES if n in lowered), None)
    if qkv is not None or ambiguous is not None:
        fused = qkv or ambiguous
        out = next((lowered[n] for n in _ATTENTION_OUTPUT_NAMES if n in lowered and lowered[n] != fused), None)
        if ambiguous is not None and published.get(f"{prefix}{ambiguous}") == "colwise" and out is not None:
            # The model's authors publish a plain column split: q, k and v are interleaved per head, so
            # contiguous rows are whole heads (their count is checked against the TP degree).
            return {ambiguous: "colwise", out: "rowwise"}
        if qkv is not None and out is not None and head_count(sub, QUERY_HEADS):
            return {qkv: "fused_qkv", out: "rowwise"}
        warn(f"{prefix}{fused}: fused q/k/v projection of unknown layout (or without head counts); left replicated.")
        return {}
    if gate_up is not None:
        out = next((lowered[n] for n in _MLP_OUTPUT_NAMES if n in lowered), None)
        if out is not None:
            return {gate_up: "fused_gate_up", out: "rowwise"}
        warn(f"{prefix}{gate_up}: fused gate/up projection without a recognised output projection; left replicated.")
        return {}
    attention = _match_attention(projections)
    if attention:
        *qkv_names, out_name = attention
        return {**{child: "colwise" for child in qkv_names}, out_name: "rowwise"}
    return _match_mlp(projections)


def _tied_modules(module: nn.Module) -> set[str]:
    """Modules holding a parameter that another module holds too."""
    owners: dict[int, set[str]] = {}
    for fqn, sub in module.named_modules(remove_duplicate=False):
        for _, param in sub.named_parameters(recurse=False):
            owners.setdefault(id(param), set()).add(fqn)
    return {fqn for names in owners.values() if len(names) > 1 for fqn in names}


#: Styles that split a projection's output features (its input is whole on every rank).
COLUMN_STYLES = ("colwise", "colwise_gather_output", "fused_qkv", "fused_gate_up", "loss_parallel")
_PROJECTION_STYLES = (*COLUMN_STYLES, "rowwise")


def check_plan(module: nn.Module, resolved: ResolvedPlan, tp_size: int) -> None:
    """Check that every split dimension, fused block and head count divides by ``tp_size``.

    Raises:
        ValueError: Naming the module, the size and the TP degree.
        TypeError: A style is applied to a module type it does not fit.
    """
    modules = dict(module.named_modules())
    for fqn, style in resolved.styles.items():
        sub = modules[fqn]
        if style in _PROJECTION_STYLES:
            if not is_projection(sub) or (style == "loss_parallel" and not isinstance(sub, nn.Linear)):
                needs = "an nn.Linear" if style == "loss_parallel" else "an nn.Linear or a transformers Conv1D"
                raise TypeError(f"{fqn}: style {style!r} needs {needs}, got {type(sub).__name__}.")
            in_features, out_features = features(sub)
            dim_name, size = ("in_features", in_features) if style == "rowwise" else ("out_features", out_features)
            _require_divisible(fqn, dim_name, size, tp_size)
        elif style == "embedding_rowwise":
            if not isinstance(sub, nn.Embedding):
                raise TypeError(f"{fqn}: style 'embedding_rowwise' needs an nn.Embedding, got {type(sub).__name__}.")
            _require_divisible(fqn, "num_embeddings", sub.num_embeddings, tp_size)
    for fqn, blocks in resolved.fused.items():
        names = ("q", "k", "v") if resolved.styles[fqn] == "fused_qkv" else ("gate", "up")
        for name, size in zip(names, blocks):
            _require_divisible(fqn, f"{name} block", size, tp_size)
    for fqn, attrs in resolved.head_attributes.items():
        for attr in attrs:
            _require_divisible(fqn, attr, _get_attribute(modules[fqn], attr), tp_size)
    _check_tied_parameters(module, resolved)


def apply_tensor_parallel(module: nn.Module, tp_mesh, resolved: ResolvedPlan, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``module`` in place over the 1-D ``tp_mesh`` and shrink its attention head counts.

    Call :func:`check_plan` first; this assumes the sizes divide.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    tp_size = tp_mesh.size()
    modules = dict(module.named_modules())
    if sequence_parallel:
        torch_plan, regions = sequence_parallel_plan(module, resolved, tp_size)
        arrives_as = Shard(1)
    else:
        torch_plan = {
            fqn: parallel_style(style, conv1d=fqn in resolved.conv1d)
            for fqn, style in resolved.styles.items()
            if style != "replicate"
        }
        # Where several column-wise projections read one input (q/k/v, gated MLPs), they get one shared
        # replicated DTensor: their input gradients add up as one partial sum, one all-reduce.
        regions, arrives_as = shared_input_regions(resolved), Replicate()
    for region in regions:
        projections = [modules[fqn] for fqn, style in resolved.styles.items() if style in COLUMN_STYLES and fqn.rpartition(".")[0] == region]
        SharedRegionInput(tp_mesh, arrives_as).attach(modules[region], projections, region)
    layouts = _order_fused_rank_major(modules, resolved, tp_size)
    parallelize_module(module, tp_mesh, torch_plan)
    if sequence_parallel:
        split_trunk_sequence(module, resolved, tp_mesh)
    for fqn, parameter_layouts in layouts.items():
        fused_layout.mark(modules[fqn], parameter_layouts)
    for fqn, style in resolved.styles.items():
        if style == "loss_parallel":
            modules[fqn].register_forward_hook(_whole_logits_in_eval)
    _divide_head_attributes(modules, resolved, tp_size)
    return module


def _order_fused_rank_major(
    modules: Mapping[str, nn.Module], resolved: ResolvedPlan, tp_size: int
) -> dict[str, dict[str, fused_layout.FusedLayout]]:
    """Reorder each fused projection's rows rank-major (before sharding); returns their layouts by module."""
    layouts: dict[str, dict[str, fused_layout.FusedLayout]] = {}
    for fqn, blocks in resolved.fused.items():
        sub = modules[fqn]
        layouts[fqn] = {}
        for name, param in sub.named_parameters(recurse=False):
            layout = fused_layout.FusedLayout(output_dim(sub, name), tuple(blocks), tp_size)
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
        if style in ("colwise", "fused_qkv", "fused_gate_up"):
            parent = fqn.rpartition(".")[0]
            parents[parent] = parents.get(parent, 0) + 1
    return [parent for parent, count in parents.items() if count > 1 and parent]


def _match_attention(linears: Mapping[str, nn.Module]) -> tuple[str, str, str, str] | None:
    for names in _ATTENTION_NAMES:
        if all(name in linears for name in names):
            return names
    return None


def _match_mlp(linears: Mapping[str, nn.Module]) -> dict[str, str]:
    items = [(name, features(m)) for name, m in linears.items()]
    if len(items) == 2:
        (first, (a_in, a_out)), (second, (b_in, b_out)) = items
        if a_out == b_in and a_in == b_out and a_out != a_in:
            return {first: "colwise", second: "rowwise"}
    if len(items) == 3:
        ins = [(n, f) for n, f in items if f[0] != f[1]]
        expand = [n for n, (i, o) in ins if o > i]
        reduce = [n for n, (i, o) in ins if o < i]
        if len(ins) == 3 and len(expand) == 2 and len(reduce) == 1:
            shapes = dict(items)
            if {shapes[n][1] for n in expand} == {shapes[reduce[0]][0]}:
                return {expand[0]: "colwise", expand[1]: "colwise", reduce[0]: "rowwise"}
    return {}


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
        attrs = [a for a in attributes if _is_count(getattr(parent, a, None))]
        config = getattr(parent, "config", None)
        if config is not None and (style == "fused_qkv" or _is_attention_projection(child)):
            attrs += [f"config.{a}" for a in attributes if _is_count(getattr(config, a, None))]
        if attrs:
            found[parent_name] = tuple(dict.fromkeys(found.get(parent_name, ()) + tuple(attrs)))
    return found


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_attention_projection(name: str) -> bool:
    lowered = name.lower()
    return lowered in _AMBIGUOUS_QKV_NAMES or any(lowered in names[:3] for names in _ATTENTION_NAMES)


def _require_divisible(fqn: str, what: str, size: int, tp_size: int) -> None:
    if size % tp_size != 0:
        raise ValueError(
            f"{fqn}.{what}={size} is not divisible by tensor_parallel_size={tp_size}. "
            f"Choose a tensor_parallel_size that divides {size}, or leave {fqn} replicated in the plan."
        )


def _check_tied_parameters(module: nn.Module, resolved: ResolvedPlan) -> None:
    owners: dict[int, list[str]] = {}
    for fqn, sub in module.named_modules():
        for pname, param in sub.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(f"{fqn}.{pname}" if fqn else pname)
    split = {fqn for fqn, style in resolved.styles.items() if style != "replicate"}
    for names in owners.values():
        modules_of = {name.rpartition(".")[0] for name in names}
        if len(modules_of) > 1 and modules_of & split:
            raise ValueError(
                f"Parameters {', '.join(names)} are tied (one tensor), but the plan splits only "
                f"{', '.join(sorted(modules_of & split))}. Leave all of them replicated, or untie the weights."
            )
