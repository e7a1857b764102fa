"""Lightning precision settings translated for the engines under the strategies."""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.fsdp import MixedPrecisionPolicy

#: Lightning's mixed-precision names and the dtype their compute runs in.
_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def fsdp_mixed_precision(plugin: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy for Lightning's ``precision`` setting.

    Under ``bf16-mixed``/``16-mixed`` sharded parameters are gathered in the low-precision dtype (half the
    all-gather bytes; autocast would cast them to it anyway) while gradients are reduced and kept in
    float32, as the master weights are. ``*-true`` and ``32``/``64`` keep every tensor in the module's dtype.
    """
    dtype = _MIXED.get(str(getattr(plugin, "precision", "")))
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
