"""What a plan needs to know about projection layers: their features, head counts, and fused blocks.

Projections are ``nn.Linear`` or transformers' ``Conv1D`` (GPT-2 and relatives: a linear layer whose
weight is stored transposed, ``[in, out]``), recognised by shape so that transformers is not imported.
Head counts are read from the attention module, or from the ``config`` it keeps (Hugging Face modules
read ``self.config.num_attention_heads`` in ``forward``). No Lightning here.
"""

from __future__ import annotations

from torch import nn

#: Attributes holding the number of query heads, then of key/value heads (module or its config).
QUERY_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KEY_VALUE_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D``: ``weight`` of shape ``[in, nf]``, output features ``nf``."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nf", None), int)
        and weight is not None
        and weight.dim() == 2
        and weight.shape[1] == module.nf
    )


def is_projection(module: nn.Module) -> bool:
    """An ``nn.Linear`` (exactly: subclasses may compute something else) or a transformers ``Conv1D``."""
    return type(module) is nn.Linear or is_conv1d(module)


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a projection."""
    if is_conv1d(module):
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return module.in_features, module.out_features


def output_dim(module: nn.Module, parameter: str) -> int:
    """The dimension of ``module.<parameter>`` that holds output features (Conv1D weights: 1)."""
    return 1 if parameter == "weight" and is_conv1d(module) else 0


def head_count(module: nn.Module | None, names: tuple[str, ...]) -> tuple[int, str] | None:
    """The first integer among ``names`` on ``module`` or its ``config``, with where it was found."""
    if module is None:
        return None
    for owner, where in ((module, ""), (getattr(module, "config", None), "config.")):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, where + name
    return None


def qkv_blocks(fqn: str, projection: nn.Module, attention: nn.Module | None) -> tuple[int, int, int]:
    """Sizes of the q, k and v blocks of a fused projection, from the attention module's head counts.

    Raises:
        ValueError: The head counts are unknown or do not explain the projection's width.
    """
    _, out = features(projection)
    query = head_count(attention, QUERY_HEADS)
    if query is None:
        raise ValueError(
            f"{fqn}: cannot split the fused q/k/v projection: its attention module has none of the head-count "
            f"attributes {', '.join(QUERY_HEADS)} (nor its config). Give the plan a 'replicate' entry for it."
        )
    heads = query[0]
    kv = head_count(attention, KEY_VALUE_HEADS)
    kv_heads = kv[0] if kv is not None else heads
    if out % (heads + 2 * kv_heads) != 0:
        raise ValueError(
            f"{fqn}: out_features={out} is not q|k|v for {heads} query and {kv_heads} key/value heads "
            f"({heads} + 2·{kv_heads} heads do not divide it): the fused layout is unknown. Leave it replicated in the plan."
        )
    head_dim = out // (heads + 2 * kv_heads)
    return heads * head_dim, kv_heads * head_dim, kv_heads * head_dim
