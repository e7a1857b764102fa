"""Parameters of a split attention module that hold one entry per head: sharded along the heads, used locally.

Some attention modules keep a parameter of their own with one value per head, read in ``forward`` next to the
heads they belong to: attention sinks (gpt-oss, GraniteSWA, MiMo: ``sinks``, ``[num_heads]``, concatenated to
each head's logits), per-head gate biases (Beam's ``gate_bias``), per-key/value-head decay rates (Doge's ``A``).
After a tensor-parallel split rank ``r`` holds a contiguous range of whole heads (every style here gives it
``r·H/tp ... (r+1)·H/tp - 1``, and the same range of key/value heads), so it needs the same range of such a
parameter: it is sharded on dim 0 (a ``Shard(0)`` DTensor, so that checkpoints and optimizers see the whole
parameter, split), and during the module's forward its attribute reads this rank's local slice (``to_local``:
the gradient flows back into the shard). A rank's heads are all computed on that rank, so the gradient of its
slice is whole there: nothing is summed. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_parallel.parallelize.tensor.projections import KEY_VALUE_HEADS, QUERY_HEADS, head_count


#: Attributes holding the width of one head (module or its config).
HEAD_WIDTHS = ("head_dim", "attention_head_size", "head_size")
#: Parameters one per head by their name, whatever the widths: attention sinks (one extra logit per head, gpt-oss's,
#: MiMo's, HY-V4's, DeepSeek-V4's ``sinks``), never a vector over a head's features.
PER_HEAD_NAMES = ("sinks",)


def find_per_head_parameters(attention: nn.Module, fqn: str = "") -> tuple[str, ...]:
    """Names of ``attention``'s own parameters whose dim 0 is its query or key/value head count.

    Raises:
        ValueError: Such a parameter's dim 0 is also the width of one head (DiffLlama's ``lambda_q1`` is
            ``[head_dim]``), so whether it holds one entry per head or per feature of a head cannot be told (except
            for attention sinks, :data:`PER_HEAD_NAMES`: one per head by definition).
    """
    counts = {found[0] for found in (head_count(attention, QUERY_HEADS), head_count(attention, KEY_VALUE_HEADS)) if found}
    if not counts:
        return ()
    width = head_count(attention, HEAD_WIDTHS)
    names = []
    for name, param in attention.named_parameters(recurse=False):
        if param.dim() >= 1 and param.shape[0] in counts:
            if width is not None and width[0] == param.shape[0] and name not in PER_HEAD_NAMES:
                raise ValueError(
                    f"{fqn or type(attention).__name__}.{name}: its {param.shape[0]} entries may be one per head (sharded "
                    f"with the heads) or one per feature of a head ({width[1]}={width[0]}, kept whole): the plan cannot "
                    f"tell which. Leave {fqn or 'the attention'} replicated in the plan."
                )
            names.append(name)
    return tuple(names)


def shard_per_head_parameters(modules: Mapping[str, nn.Module], per_head: Mapping[str, tuple[str, ...]], tp_mesh: Any) -> None:
    """Shard each per-head parameter on dim 0 and make ``forward`` read this rank's slice of it."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for fqn, names in per_head.items():
        attention = modules[fqn]
        for name in names:
            param = attention._parameters[name]
            placed = distribute_tensor(param.detach(), tp_mesh, [Shard(0)], src_data_rank=None)
            attention.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))
        attention.register_forward_pre_hook(LocalView(names).enter)
        attention.register_forward_hook(LocalView(names).leave, always_call=True)


class LocalView:
    """Puts ``to_local()`` of the named DTensor parameters in the module's ``__dict__`` for one forward.

    Attribute lookup finds the instance ``__dict__`` before ``nn.Module.__getattr__`` looks in ``_parameters``,
    so ``self.sinks`` reads the local slice in ``forward`` while ``named_parameters`` and ``state_dict`` keep
    the sharded parameter.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def enter(self, module: nn.Module, *_: Any) -> None:
        for name in self.names:
            module.__dict__[name] = module._parameters[name].to_local()

    def leave(self, module: nn.Module, *_: Any) -> None:
        for name in self.names:
            module.__dict__.pop(name, None)


def find_per_head_children(attention: nn.Module, fqn: str = "") -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Children of ``attention`` that work head by head: ``{child FQN: (parameter names, head-count attributes)}``.

    A child (not a projection) keeping a head count of its own equal to the attention's query heads and a head width
    (``num_heads`` and ``head_dim``: xLSTM's multi-head norm, which checks its input has that many heads and scales
    ``heads·head_dim`` features), all of whose own parameters are vectors of ``heads·head_dim`` features, normalises or
    scales each head alone: its parameters shard with the heads (``Shard(0)``, read locally in its forward) and its
    head count is divided, so it runs on this rank's heads as on one device.
    """
    heads = head_count(attention, QUERY_HEADS)
    if heads is None:
        return {}
    found = {}
    for child, sub in attention.named_children():
        own = {name: value for name in QUERY_HEADS if isinstance(value := vars(sub).get(name), int) and not isinstance(value, bool)}
        width = next((value for name in HEAD_WIDTHS if isinstance(value := vars(sub).get(name), int)), None)
        params = list(sub.named_parameters(recurse=False))
        if not own or set(own.values()) != {heads[0]} or width is None or not params or any(True for _ in sub.children()):
            continue
        if all(param.dim() == 1 and param.shape[0] == heads[0] * width for _, param in params):
            found[f"{fqn}.{child}" if fqn else child] = (tuple(name for name, _ in params), tuple(own))
    return found
