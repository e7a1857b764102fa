"""A per-head projection reading every head's values (Doge's ``dt_proj``): its input gathered, its output split by heads.

Doge's attention computes one value per key/value head from the values of *every* head
(``dt_proj(values.reshape(B, T, heads·head_dim))``), beside its q/k/v/o projections. With the heads split, each rank
holds only its heads' values; the projection is split like its heads (``colwise_gather_input``: rank ``r`` computes
its heads' outputs) and reads the whole input: a tensor arriving as this rank's slice (``in_features / tp`` wide,
rank-major like every column split) is all-gathered along its features first. The gathered tensor then enters the
column split as a replicated input, whose gradient the split sums over the group; the gather's backward keeps this
rank's part of that whole gradient. A tensor arriving whole (the attention's input, as a gate reads it) passes as it
is. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

STYLE = "colwise_gather_input"


class GatherSplitInput:
    """Forward pre-hook: the projection's first input whole (gathered where it arrives as this rank's slice)."""

    def __init__(self, fqn: str, in_features: int, tp_mesh: Any) -> None:
        self.fqn, self.in_features, self.mesh = fqn, in_features, tp_mesh

    def __call__(self, module: nn.Module, args: tuple) -> tuple | None:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not args or not isinstance(args[0], Tensor) or isinstance(args[0], DTensor):
            return None
        tensor = args[0]
        width = tensor.shape[-1]
        if width == self.in_features:
            return None
        if width * self.mesh.size() != self.in_features:
            raise RuntimeError(
                f"{self.fqn} (style {STYLE!r}) got an input of {width} features: neither its whole {self.in_features} "
                f"nor this rank's {self.in_features // self.mesh.size()} of them. Leave its attention replicated in the plan."
            )
        whole = DTensor.from_local(tensor.contiguous(), self.mesh, [Shard(tensor.dim() - 1)], run_check=False)
        return (whole.redistribute(self.mesh, [Replicate()]).to_local(), *args[1:])


def gather_split_inputs(modules: Mapping[str, nn.Module], styles: Mapping[str, str], tp_mesh: Any) -> None:
    """Hook :class:`GatherSplitInput` before every ``colwise_gather_input`` projection's own input handling."""
    for fqn, style in styles.items():
        if style == STYLE:
            module = modules[fqn]
            module.register_forward_pre_hook(GatherSplitInput(fqn, int(module.in_features), tp_mesh), prepend=True)
