"""Attention regions whose low-rank latent projections stay replicated beside split heads (multi-head latent attention).

DeepSeek-V2/V3's multi-head latent attention (and MiniCPM3, GLM-4-MoE-Lite, Kimi, Youtu, ...) first projects the
hidden states down to small latents — ``q_a_proj`` (``H → q_lora_rank``) and ``kv_a_proj_with_mqa``
(``H → kv_lora_rank + rope_dim``) — normalises them, and only then projects them up per head (``q_b_proj``,
``kv_b_proj``). The up projections split by heads as any attention's do; the down projections cannot (their
output is every head's latent). Left replicated, they run alike on every rank, but part of their output reaches
this rank's heads *without* passing a split projection: the rotary key ``k_pe`` is shared by every head and is
broadcast to them. Its gradient on a rank is then a partial sum over that rank's heads, added, in the down
projection's output gradient, to the whole gradient that the split up projection's input brings back. Nothing
can reduce one term and not the other after autograd has added them.

So such a region computes every gradient it produces as a **partial sum** (Megatron's rule for replicated weights
used on a rank's slice, applied to the whole region):

- the input gradient of each column-split projection, which torch's style all-reduces into the whole one, is
  divided by ``tp`` (each rank then contributes ``1/tp`` of it);
- the region's floating inputs enter as replicated tensors whose gradient is all-reduced in backward (the hidden
  states' gradient leaving the region is whole again);
- every replicated parameter of the region (the latent projections, their norms, per-head norms) gets a partial
  gradient, summed over the group after backward with the other split-region parameters
  (:func:`~lightning_parallel.parallelize.tensor.split_region.reduce_split_region_gradients`).

Backward is linear in the incoming gradient, and every value in forward is the unsplit model's (replicated
tensors alike on every rank, per-head tensors this rank's heads), so the sums are the unsplit gradients exactly.
The price is one all-reduce more per region in backward. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from lightning_parallel.parallelize.tensor.partial_gradients import ScaleGradient, gradient_summed
from lightning_parallel.parallelize.tensor.projections import features, is_projection
from lightning_parallel.parallelize.tensor.split_region import PartialSumParameters, regions_of

def latent_projections(modules: Mapping[str, nn.Module], styles: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Split regions -> their projections left replicated that are latent down projections.

    A projection left replicated beside split ones is a latent down projection when it reads the region's input
    width (the width its row-wise projection writes back) and its output is the input of one of the region's
    column-split projections, possibly followed by a narrower part shared by every head (``kv_lora_rank +
    rope_dim``: at most as wide again as that input). Anything else left replicated inside a region is not
    recognised (its output may be combined with this rank's heads in ways the plan cannot know).
    """
    found: dict[str, tuple[str, ...]] = {}
    for name, (opening, closing) in regions_of(styles).items():
        region_width = {features(modules[f"{name}.{c}"])[1] for c in closing if is_projection(modules[f"{name}.{c}"])}
        up_inputs = {features(modules[f"{name}.{c}"])[0] for c in opening if is_projection(modules[f"{name}.{c}"])} - region_width
        latent = []
        for child, sub in modules[name].named_children():
            fqn = f"{name}.{child}"
            if fqn in styles or not is_projection(sub):
                continue
            width_in, width_out = features(sub)
            if width_in in region_width and any(up <= width_out < 2 * up for up in up_inputs):
                latent.append(fqn)
        if latent:
            found[name] = tuple(latent)
    return found


class LatentRegion:
    """The hooks that make one region compute partial-sum gradients (see the module docstring).

    Args:
        mesh: The tensor-parallel mesh.
        name: The region's FQN, for messages.
    """

    def __init__(self, mesh: Any, name: str) -> None:
        self.mesh, self.name = mesh, name
        self._scaled: list[tuple[Tensor, Tensor]] = []

    def attach(self, region: nn.Module, column_projections: list[nn.Module], split: set[str], per_head: tuple[str, ...] = ()) -> None:
        """Hook ``region`` and its ``column_projections`` (after their styles and shared inputs are applied).

        Its children not in ``split`` (child names) and its own parameters not in ``per_head`` (sharded by head)
        hold the parameters whose gradients are partial sums.
        """
        region.register_forward_pre_hook(self._enter, with_kwargs=True)
        region.register_forward_hook(self._leave, always_call=True)
        for projection in column_projections:
            # First among the projection's hooks: the shared-input and style hooks then see the scaled tensor.
            projection.register_forward_pre_hook(self._scale_input_gradient, prepend=True)
        replicated = [sub for child, sub in region.named_children() if child not in split]

        def partial_sums() -> list[nn.Parameter]:
            # Looked up when reduced: wrapping (FSDP2 over data-parallel replicas) may replace the parameters.
            own = [p for name, p in region.named_parameters(recurse=False) if name not in per_head]
            return own + [p for sub in replicated for p in sub.parameters()]

        region._split_region_parameters = PartialSumParameters(self.mesh.get_group(), self.name, partial_sums)

    def _enter(self, _: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self._scaled = []
        return tuple(gradient_summed(a, self.mesh) for a in args), {k: gradient_summed(v, self.mesh) for k, v in kwargs.items()}

    def _leave(self, *_: Any) -> None:
        self._scaled = []

    def _scale_input_gradient(self, _: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], Tensor) or not args[0].requires_grad:
            return None
        tensor = args[0]
        for seen, scaled in self._scaled:
            if seen is tensor:  # q/k/v reading one tensor keep sharing one input (one all-reduce)
                return (scaled, *args[1:])
        scaled = ScaleGradient.apply(tensor, 1.0 / self.mesh.size())
        self._scaled.append((tensor, scaled))
        return (scaled, *args[1:])
