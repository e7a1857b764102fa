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

import difflib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from lightning_parallel.parallelize.sequence import sequence_parallel_plan
from lightning_parallel.parallelize.tensor_plan import (
    STYLE_ALIASES,
    STYLES,
    ResolvedPlan,
    parallel_style,
)

# STYLES and ResolvedPlan live in tensor_plan, so that sequence.py and stage_tensor.py use them without
# importing this module; they stay importable from here too (tests and callers do).

log = logging.getLogger(__name__)

#: Attribute names under which attention modules commonly keep their head counts.
HEAD_ATTRIBUTES: tuple[str, ...] = (
    "n_head", "n_heads", "num_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads", "n_local_heads",
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
# Fused projections that a column split would cut across q/k/v: never split automatically.
_FUSED_QKV_NAMES = ("qkv", "c_attn", "in_proj", "wqkv", "qkv_proj", "query_key_value")


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
        plan = infer_plan(module, warn) if self.plan == "auto" else dict(self.plan)
        return resolve_plan(module, plan, self.head_attributes)


def resolve_plan(module: nn.Module, plan: Mapping[str, str], head_attributes: tuple[str, ...] = HEAD_ATTRIBUTES) -> ResolvedPlan:
    """Bind a ``{pattern: style}`` plan to ``module``'s submodule names.

    Raises:
        ValueError: A style is unknown, a pattern matches no submodule (the error lists near matches), or
            two patterns give one module different styles.
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
    return ResolvedPlan(styles=styles, head_attributes=_attention_heads(modules, styles, head_attributes))


def infer_plan(module: nn.Module, warn: Callable[[str], None] = log.warning) -> dict[str, str]:
    """Build a Megatron-style plan from the module tree; returns ``{FQN: style}`` (an exact-name plan).

    - attention with separate q/k/v/output projections (conventional names): q/k/v column-wise, output row-wise;
    - MLPs, recognised by shape among a module's direct ``nn.Linear`` children: ``d→h, h→d`` (first
      column-wise, second row-wise) and gated ``d→h, d→h, h→d`` (SwiGLU: the two inputs column-wise);
    - fused q/k/v projections and ``nn.MultiheadAttention`` stay replicated, with a warning naming them;
    - everything else (embeddings, norms, heads) stays replicated.
    """
    plan: dict[str, str] = {}
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(sub, nn.MultiheadAttention):
            warn(f"{name or type(sub).__name__}: nn.MultiheadAttention keeps q/k/v fused; left replicated.")
            continue
        linears = {child: m for child, m in sub.named_children() if type(m) is nn.Linear}
        fused = [child for child in linears if child.lower() in _FUSED_QKV_NAMES]
        if fused:
            warn(f"{prefix}{fused[0]}: fused q/k/v projection cannot be split column-wise without mixing q, k and v; left replicated.")
            continue
        attention = _match_attention(linears)
        if attention:
            *qkv, out = attention
            plan.update({f"{prefix}{child}": "colwise" for child in qkv})
            plan[f"{prefix}{out}"] = "rowwise"
            continue
        plan.update({f"{prefix}{child}": style for child, style in _match_mlp(linears).items()})
    return plan


def check_plan(module: nn.Module, resolved: ResolvedPlan, tp_size: int) -> None:
    """Check that every split dimension and head count divides by ``tp_size``.

    Raises:
        ValueError: Naming the module, the size and the TP degree.
        TypeError: A style is applied to a module type it does not fit.
    """
    modules = dict(module.named_modules())
    for fqn, style in resolved.styles.items():
        sub = modules[fqn]
        if style in ("colwise", "rowwise", "loss_parallel"):
            if not isinstance(sub, nn.Linear):
                raise TypeError(f"{fqn}: style {style!r} needs an nn.Linear, got {type(sub).__name__}.")
            dim_name, size = ("in_features", sub.in_features) if style == "rowwise" else ("out_features", sub.out_features)
            _require_divisible(fqn, dim_name, size, tp_size)
        elif style == "embedding_rowwise":
            if not isinstance(sub, nn.Embedding):
                raise TypeError(f"{fqn}: style 'embedding_rowwise' needs an nn.Embedding, got {type(sub).__name__}.")
            _require_divisible(fqn, "num_embeddings", sub.num_embeddings, tp_size)
    for fqn, attrs in resolved.head_attributes.items():
        for attr in attrs:
            _require_divisible(fqn, attr, getattr(modules[fqn], attr), tp_size)
    _check_tied_parameters(module, resolved)


def apply_tensor_parallel(module: nn.Module, tp_mesh, resolved: ResolvedPlan, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``module`` in place over the 1-D ``tp_mesh`` and shrink its attention head counts.

    Call :func:`check_plan` first; this assumes the sizes divide.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        parallelize_module,
    )

    tp_size = tp_mesh.size()
    if sequence_parallel:
        torch_plan = sequence_parallel_plan(module, resolved, tp_size)
    else:
        torch_plan = {fqn: parallel_style(style) for fqn, style in resolved.styles.items() if style != "replicate"}
        # Where several column-wise projections read one input (q/k/v, gated MLPs), hand them a single
        # replicated DTensor: their input gradients then add up as one partial sum and cost one
        # all-reduce instead of one each (Megatron's minimum).
        for region in shared_input_regions(resolved):
            torch_plan[region] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
            )
    parallelize_module(module, tp_mesh, torch_plan)
    modules = dict(module.named_modules())
    for fqn, style in resolved.styles.items():
        if style == "loss_parallel":
            modules[fqn].register_forward_hook(_whole_logits_in_eval)
    for fqn, attrs in resolved.head_attributes.items():
        for attr in attrs:
            # The module reshapes its local q/k/v into heads: each rank now holds 1/tp of them.
            setattr(modules[fqn], attr, getattr(modules[fqn], attr) // tp_size)
    return module


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
        if style == "colwise":
            parent = fqn.rpartition(".")[0]
            parents[parent] = parents.get(parent, 0) + 1
    return [parent for parent, count in parents.items() if count > 1 and parent]


def _match_attention(linears: Mapping[str, nn.Linear]) -> tuple[str, str, str, str] | None:
    for names in _ATTENTION_NAMES:
        if all(name in linears for name in names):
            return names
    return None


def _match_mlp(linears: Mapping[str, nn.Linear]) -> dict[str, str]:
    items = list(linears.items())
    if len(items) == 2:
        (first, a), (second, b) = items
        if a.out_features == b.in_features and a.in_features == b.out_features and a.out_features != a.in_features:
            return {first: "colwise", second: "rowwise"}
    if len(items) == 3:
        ins = [(n, m) for n, m in items if m.in_features != m.out_features]
        expand = [n for n, m in ins if m.out_features > m.in_features]
        reduce = [n for n, m in ins if m.out_features < m.in_features]
        if len(ins) == 3 and len(expand) == 2 and len(reduce) == 1:
            hidden = {linears[n].out_features for n in expand}
            if hidden == {linears[reduce[0]].in_features}:
                return {expand[0]: "colwise", expand[1]: "colwise", reduce[0]: "rowwise"}
    return {}


def _attention_heads(modules: Mapping[str, nn.Module], styles: Mapping[str, str], attributes: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Parents of column-split projections that keep an integer head count: those counts shrink per rank."""
    found: dict[str, tuple[str, ...]] = {}
    for fqn, style in styles.items():
        if style != "colwise":
            continue
        parent = fqn.rpartition(".")[0]
        attrs = tuple(a for a in attributes if isinstance(getattr(modules.get(parent), a, None), int) and not isinstance(getattr(modules[parent], a), bool))
        if attrs:
            found[parent] = attrs
    return found


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
