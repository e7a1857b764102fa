"""The ``attn_mask`` a model hands ``F.scaled_dot_product_attention`` under context parallelism, in the ring's form.

Ring attention (:mod:`.ring_attention`) takes a mask as this rank's query rows (local order) × every key of the
sequence (global order), so that each ring step reads the block of its query and key chunks. What the model
passes is one of:

* a mask over the whole sequence's keys (last dim = the whole length): built from the whole sequence — a
  ``[batch, 1, L, L]`` mask passed into the model call (not split: dim 1 is not the sequence), a ``[batch, L, L]``
  one (split by rows at the call), or one Hugging Face builds from the whole ``attention_mask`` and
  ``position_ids`` (:mod:`.hf_masks`). Its rows are taken at this rank's positions where it has all ``L``;
* a mask over keys only (one query row, the last dim this rank's keys: a padding mask ``mask[:, None, None, :]``
  of the split ``attention_mask``): the ranks' columns are gathered (one small all-gather);
* a mask over queries only (one key column): as it is;
* a mask the model built inside its forward from the split inputs and positions: over this rank's queries × its own
  keys, but followed over the whole sequence alongside (:mod:`.whole`), whose rows are used; where it could not be
  followed it holds only the diagonal block of the ring, so it runs only where it is exactly the causal mask
  (``is_causal=True``) or keeps everything (no mask) — the ranks agree on that — and is refused otherwise, saying
  how to pass a whole one.

No Lightning here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel import collectives
from lightning_parallel.measure.collectives import context_parallel_exchange
from lightning_parallel.parallelize.context.ops import mask_pattern, agree

if TYPE_CHECKING:
    from lightning_parallel.parallelize.context.sequence import SequenceLayout


def four_dims(mask: Tensor) -> Tensor:
    """``mask`` with leading dims of 1 up to ``[batch, heads, queries, keys]`` (SDPA's broadcasting)."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask


def ring_mask(mask: Tensor, layout: SequenceLayout, group: dist.ProcessGroup | None) -> tuple[Tensor | None, bool]:
    """``mask`` as ring attention takes it: ``(mask, False)`` with this rank's query rows × the whole sequence's keys
    (or one of either, broadcast); ``(None, True)`` for the causal mask and ``(None, False)`` for a mask that keeps
    everything, where only this rank's block is known.

    Raises:
        TypeError: The mask's shape fits no form above, or it covers this rank's block only and is neither causal
            nor all-keeping (on every rank: the ranks agree first).
    """
    mask = four_dims(mask)
    rows, columns = mask.shape[-2:]
    whole, local = layout.length, layout.local_length
    if columns == whole:
        if rows == whole:
            return mask.index_select(-2, layout.positions(mask.device)), False
        if rows in (local, 1):
            return mask, False
    elif columns == local:
        if rows == 1:
            return _gather_key_columns(mask, layout, group), False
        if rows == local:
            return _local_block(mask, layout, group)
    elif columns == 1:
        if rows == whole:
            return mask.index_select(-2, layout.positions(mask.device)), False
        if rows in (local, 1):
            return mask, False
    raise TypeError(
        f"scaled_dot_product_attention got an attn_mask of shape {tuple(mask.shape)} under context parallelism, where "
        f"each rank holds {local} of the {whole} positions: the mask's last two dims must be (queries, keys) with "
        f"queries {local} (this rank's), {whole} (the whole sequence) or 1, and keys {whole}, {local} (with one query "
        "row) or 1."
    )


def _gather_key_columns(mask: Tensor, layout: SequenceLayout, group: dist.ProcessGroup | None) -> Tensor:
    """A mask over this rank's keys (one query row) made one over every key, in global order."""
    if layout.size == 1:
        return mask
    sent = mask.to(torch.uint8) if mask.dtype == torch.bool else mask
    with context_parallel_exchange():
        gathered = collectives.functional_all_gather(sent.contiguous(), mask.dim() - 1, group)
    gathered = gathered.index_select(-1, layout.global_order(mask.device))
    return gathered.bool() if mask.dtype == torch.bool else gathered


def _local_block(mask: Tensor, layout: SequenceLayout, group: dist.ProcessGroup | None) -> tuple[None, bool]:
    causal, everything, where = mask_pattern(mask, layout.positions(mask.device))
    causal, everything = agree([causal, everything], group, mask.device)
    if causal or everything:
        return None, causal and not everything
    raise TypeError(
        f"scaled_dot_product_attention got an attn_mask (shape {tuple(mask.shape)}) under context parallelism that "
        f"covers this rank's {layout.local_length} queries × its own {layout.local_length} keys only (the model built "
        "it from its part of the sequence through ops context parallelism does not follow over the whole sequence: "
        "elementwise, comparison, logical, where/masked_fill and view ops on the call's integer inputs and on "
        "positions are followed), and is neither the causal mask nor all-keeping: "
        f"{where or 'it differs from the causal mask at the positions of another context-parallel rank'}. "
        "Ring attention needs the mask over the whole sequence's keys: pass it to the model call built from the whole "
        f"batch (a [batch, 1, {layout.length}, {layout.length}] or [batch, {layout.length}, {layout.length}] tensor, "
        "boolean or additive), or, with a Hugging Face model, pass attention_mask and position_ids (transformers' "
        "mask builders see the whole sequence); or set context_parallel_size=1."
    )


__all__ = ["four_dims", "ring_mask"]
