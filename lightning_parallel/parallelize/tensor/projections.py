"""What a plan needs to know about projection layers: their features, head counts, and fused blocks.

Projections are ``nn.Linear`` or transformers' ``Conv1D`` (GPT-2 and relatives: a linear layer whose
weight is stored transposed, ``[in, out]``), recognised by shape so that transformers is not imported.
Head counts are read from the attention module, or from the ``config`` it keeps (Hugging Face modules
read ``self.config.num_attention_heads`` in ``forward``). No Lightning here.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

#: Attributes holding the number of query heads, then of key/value heads (module or its config).
QUERY_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
#: (LitGPT keeps ``n_query_groups`` on its ``config`` dataclass; never ``num_key_value_groups``: in transformers
#: that is the ratio of query to key/value heads.)
KEY_VALUE_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_query_groups")


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
    """An ``nn.Linear`` (or a subclass computing the same map, see :func:`computes_linear`) or a transformers ``Conv1D``."""
    return (isinstance(module, nn.Linear) and computes_linear(type(module))) or is_conv1d(module)


@cache
def computes_linear(cls: type[nn.Linear]) -> bool:
    """Whether instances of an ``nn.Linear`` subclass compute ``x @ W.T + b`` with nothing else.

    Subclasses that keep ``nn.Linear.forward`` do; one that overrides it (Falcon's ``FalconLinear``: the
    same map written as ``x @ W.T + b``; a LoRA or quantised layer: something else) is checked once on a
    small probe instance of the class, with and without a bias. A subclass that cannot be probed so (its
    forward needs state its own ``__init__`` sets) is not a projection: the plan leaves it whole.
    """
    if cls.forward is nn.Linear.forward:
        return True
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=generator)
    for bias in (True, False):
        probe = cls.__new__(cls)
        nn.Linear.__init__(probe, 5, 4, bias=bias, dtype=torch.float64)
        with torch.no_grad():
            probe.weight.copy_(torch.randn(4, 5, dtype=torch.float64, generator=generator))
            if bias:
                probe.bias.copy_(torch.randn(4, dtype=torch.float64, generator=generator))
            try:
                y = probe(x)
            except Exception:  # noqa: BLE001 - any failure means "not a plain linear map we can split"
                return False
            if not isinstance(y, torch.Tensor) or y.shape != (2, 3, 4) or not torch.allclose(y, F.linear(x, probe.weight, probe.bias)):
                return False
    return True


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a projection."""
    if is_conv1d(module):
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return module.in_features, module.out_features


def output_dim(module: nn.Module, parameter: str) -> int:
    """The dimension of ``module.<parameter>`` that holds output features (Conv1D weights: 1)."""
    return 1 if parameter == "weight" and is_conv1d(module) else 0


def read_attribute(owner: object, name: str) -> object:
    """``getattr(owner, name, None)``, also ``None`` where reading raises something else: a config that holds ``name``
    per layer refuses to give one value for the model (transformers' ``AmbiguousGlobalPerLayerAttributeError``,
    DOTS3's ``num_attention_heads``), and the attention module then reads its own count."""
    try:
        return getattr(owner, name, None)
    except Exception:  # noqa: BLE001 - any refusal means: no single value here
        return None


def head_count(module: nn.Module | None, names: tuple[str, ...]) -> tuple[int, str] | None:
    """The first integer among ``names`` on ``module`` or its ``config``, with where it was found."""
    if module is None:
        return None
    for owner, where in ((module, ""), (getattr(module, "config", None), "config.")):
        for name in names:
            value = read_attribute(owner, name) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, where + name
    return None


def qkv_blocks(fqn: str, projection: nn.Module, attention: nn.Module | None) -> tuple[int, int, int]:
    """Sizes of the q, k and v blocks of a fused projection, from the attention module's head counts.

    Raises:
        ValueError: The head counts are unknown or do not explain the projection's width.
    """
    _, out = features(projection)
    heads, kv_heads = qkv_heads(fqn, projection, attention)
    head_dim = out // (heads + 2 * kv_heads)
    return heads * head_dim, kv_heads * head_dim, kv_heads * head_dim


def qkv_heads(fqn: str, projection: nn.Module, attention: nn.Module | None) -> tuple[int, int]:
    """``(query heads, key/value heads)`` of a fused q/k/v projection, read from its attention module.

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
        where = kv[1] if kv is not None else f"no key/value head count among {', '.join(KEY_VALUE_HEADS)}"
        raise ValueError(
            f"{fqn}: out_features={out} is not q|k|v for {heads} query and {kv_heads} key/value heads ({query[1]}; {where}): "
            f"{heads} + 2·{kv_heads} heads do not divide it, so the fused layout is unknown. Leave it replicated in the plan."
        )
    return heads, kv_heads
