"""The tensor-parallel plan a Hugging Face model publishes for itself, in our style names.

transformers models carry ``_tp_plan`` (``{"model.layers.*.self_attn.q_proj": "colwise", "lm_head":
"colwise_gather_output", ...}``, relative to the model). :func:`published_plan` finds every such model
inside a module, expands the patterns to module names relative to that module, and keeps the entries
whose style has an exact equivalent here. transformers itself is not imported. No Lightning here.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

#: transformers style -> ours. Others (``local_*``, ``gather``, ``sequence_parallel``, ``replicated_with_grad_allreduce``,
#: ``colwise_gather_output`` on inner projections, ...) are left to our own inference.
_STYLE_MAP = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "rowwise_split_input": "rowwise",
    "embedding_rowwise": "embedding_rowwise",
}
# A gathered column split is only kept for the output head: on inner projections ours splits heads instead.
_HEAD_STYLES = {"colwise_gather_output": "colwise_gather_output"}


def published_plan(module: nn.Module) -> dict[str, str]:
    """``{module name: style}`` from the ``_tp_plan`` of every Hugging Face model inside ``module``."""
    plan: dict[str, str] = {}
    names = [name for name, _ in module.named_modules()]
    for root, sub in module.named_modules():
        published = getattr(sub, "_tp_plan", None)
        if not isinstance(published, dict) or not published or _inside_published(root, plan):
            continue
        prefix = f"{root}." if root else ""
        head_names = {f"{prefix}{n}" for n in _output_head_names(sub)}
        for pattern, style in published.items():
            for name in names:
                if not name.startswith(prefix) or not fnmatchcase(name[len(prefix) :], pattern):
                    continue
                ours = _STYLE_MAP.get(style) or (_HEAD_STYLES.get(style) if name in head_names else None)
                if ours is not None:
                    plan.setdefault(name, ours)
    return plan


def _inside_published(root: str, plan: dict[str, str]) -> bool:
    # A base model inside a model with a published plan: the outer plan already covers it.
    return any(name.startswith(f"{root}.") for name in plan) if root else False


def _output_head_names(model: nn.Module) -> list[str]:
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    return [name for name, sub in model.named_modules() if head is not None and sub is head]
