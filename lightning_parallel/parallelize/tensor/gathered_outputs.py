"""Groups that cannot compute on a rank's slice, split over their output features with every output gathered whole.

A Megatron split (column-wise then row-wise) computes on each rank's slice of the hidden units or channels. Some
groups cannot: an MLP computing a statistic over its hidden units (Gemma-3n's activation sparsity keeps the gate's
values above ``mean + k·std`` over every hidden unit), or a recurrence over channels whose state the model allocates
outside the module at the whole width (RWKV's time-mix block writes its per-channel state into the model's
``state`` list in evaluation). Their projections can still be stored split: each projection splits over its output
features and its output is all-gathered (``colwise_gather_output``), so everything between the projections runs on
whole tensors on every rank, as on one device, whatever it computes (exact by construction; the weights and the
projections' products are divided, the activations between them are not). Backward: each rank keeps its part of
the output gradient, and the input gradient's partial sums are all-reduced (torch's column split does both).
No Lightning here.
"""

from __future__ import annotations

from collections.abc import Mapping

STYLE = "colwise_gather_output"
#: Styles of a Megatron group that its gathered form replaces (``replicate`` entries stay as they are).
_SPLIT = ("colwise", "rowwise", "fused_gate_up")


def gathered(unit: Mapping[str, str]) -> dict[str, str]:
    """``unit`` (one MLP's styles) with every split projection's output gathered whole instead; ``{}`` if it splits
    anything another way (experts, fused q|k|v blocks, a convolution's channels)."""
    if any(style not in (*_SPLIT, "replicate") for style in unit.values()):
        return {}
    return {fqn: STYLE if style in _SPLIT else style for fqn, style in unit.items()}
