"""Tensor parallelism: each layer's weights split across the ``tp`` ranks (Megatron-style) with DTensor.

:mod:`.plan` (plan data and styles → torch ``ParallelStyle``), :mod:`.apply` (applies a plan: resolution,
refusals, what stays whole), :mod:`.inference` (the auto plan: attention and MLP units found in the model),
:mod:`.published_plan` (a transformers model's ``_tp_plan``), :mod:`.projections` (Linear/Conv1D, head counts),
:mod:`.fused` (fused q|k|v and gate|up blocks, module-order state), :mod:`.region_input` (inputs shared by a
split region), :mod:`.split_region` (gradients of replicated parameters inside a region), :mod:`.head_inputs`
(per-head inputs such as ALiBi cut to a rank's heads), :mod:`.sequence` (sequence parallelism),
:mod:`.dtensor_ops` (DTensor sharding rules for CPU attention kernels).
"""
