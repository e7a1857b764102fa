"""A transformers model's tensors in the layout its Hub checkpoints use, group by group.

transformers 5 holds some families differently in memory than on the Hub: Mixture-of-Experts layers keep their
experts fused (``...mlp.experts.gate_up_proj [E, 2·I, H]``, ``down_proj [E, H, I]``) where the Hub stores one module
per expert (``...block_sparse_moe.experts.3.w1.weight``), and some modules are renamed. ``from_pretrained`` converts
through the model type's conversion mapping; ``save_pretrained`` reverts it (its ``save_original_format=True``
default) with ``transformers.core_model_loading.revert_weight_conversion``. This module runs that same function, so
an export writes what ``save_pretrained`` of the trained model would, for every family transformers maps (and the
names unchanged where it maps nothing), with no per-family table of ours. ``expert_conversion.PerExpertSource``
reads the same mapping the other way (``weights_from`` a Hub directory).

An export reads a few tensors at a time, so the conversion runs on groups: :func:`plan` runs it on the meta device,
once on the whole state and once per converted tensor; where the per-tensor results add up to the whole one (every
mapping transformers ships for MoE experts: each fused tensor becomes its experts' tensors on its own), each tensor is
a group of its own. A mapping whose outputs need several tensors together (a reverse that joins them) is one group.
No Lightning here; transformers is imported only when a model is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class HubGroup:
    """Tensors of the model (``inputs``, its own names) converted together into the Hub's ``outputs``."""

    inputs: tuple[str, ...]
    outputs: dict[str, tuple[tuple[int, ...], torch.dtype]]  # Hub name -> (shape, dtype), in written order
    #: Whether the Hub layout differs from the model's for these tensors (renamed, split, joined or transposed).
    renamed: bool = True


def plan(model: Any, tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> list[HubGroup]:
    """The groups in which ``tensors`` (the model's names, in the order to write them) convert to the Hub layout.

    The conversion runs once on the whole state on the meta device. A tensor it hands back as the same object is
    written on its own, under the name it got (kept or renamed); only the others (what converters made: split
    experts, transposes, even of a square tensor) are converted once more each, alone, and form a group each where
    those results add up to the whole run's; else they form one group.

    Args:
        model: The transformers model (on the meta device will do): its type's conversion mapping is used.
        tensors: Name -> (shape, dtype) of every tensor to write (tied copies left out, as ``save_pretrained`` does).
    """
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in tensors.items()}
    whole = to_hub_layout(model, meta)
    inputs = {id(tensor) for tensor in meta.values()}
    passed = {id(tensor): out for out, tensor in whole.items() if id(tensor) in inputs}  # renamings hand the tensor on
    sources = [name for name in tensors if id(meta[name]) not in passed]  # what the converters take
    made = {out: sig for out, sig in _signature(whole).items() if id(whole[out]) not in inputs}
    alone: dict[str, HubGroup] = {}
    for name in sources:
        try:
            alone[name] = HubGroup((name,), _signature(to_hub_layout(model, {name: meta[name]})))
        except Exception:  # noqa: BLE001 - any op of the reverse may refuse one tensor alone: convert them together
            alone = {}
            break
    outputs = [out for group in alone.values() for out in group.outputs]
    on_their_own = len(set(outputs)) == len(outputs) and {o: sig for g in alone.values() for o, sig in g.outputs.items()} == made
    groups = []
    for name in tensors:
        if name not in alone and id(meta[name]) in passed:
            out = passed[id(meta[name])]
            groups.append(HubGroup((name,), {out: tensors[name]}, renamed=out != name))
        elif on_their_own:
            groups.append(alone[name])
        elif name == sources[0]:  # all that converters take in one group, where the first of them is
            groups.append(HubGroup(tuple(sources), made))
    return groups


def to_hub_layout(model: Any, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``values`` (the model's names, whole tensors) under the Hub's names and layout, by transformers' own reverse
    conversion (views of ``values`` where it only splits them)."""
    # The function save_pretrained calls (transformers.modeling_utils); a module-level function of
    # transformers.core_model_loading, not in its top-level API: checked against transformers 5.25.0.
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, dict(values)))


def converted(model: Any, group: HubGroup, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``group``'s tensors converted, checked against what :func:`plan` expected of them.

    Raises:
        RuntimeError: The conversion of real tensors gave other names, shapes or dtypes than on the meta device.
    """
    if not group.renamed:
        return {name: values[name] for name in group.inputs}
    outputs = to_hub_layout(model, {name: values[name] for name in group.inputs})
    if _signature(outputs) != group.outputs:
        raise RuntimeError(
            f"transformers' reverse conversion of {list(group.inputs)[:3]} gave {sorted(_signature(outputs).items())[:3]}, not the "
            f"planned {sorted(group.outputs.items())[:3]}; export with original_format=False (--no-original-format) to keep "
            "the model's own layout, which transformers 5 loads too."
        )
    return {name: outputs[name] for name in group.outputs}


def _signature(tensors: Mapping[str, Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
