"""Context parallelism: each sequence split across the ``cp`` ranks, attention as a ring.

:mod:`.sequence` (the head-tail split and the differentiable gather), :mod:`.splitter` (the split at the
model call and the torch function mode that makes the model see whole-sequence positions), :mod:`.ops` (ops
along the sequence: global cumsum/diff, refusals), :mod:`.masks` (the model's attention mask in the ring's form:
this rank's queries × every key), :mod:`.hf_masks` and :mod:`.whole` (transformers' mask builders called with the
whole sequence), :mod:`.ring_plan` (which blocks each ring step computes, skips, or masks), :mod:`.ring_attention`
and :mod:`.kernels` (the ring over the fused kernels, behind SDPA's signature).
"""
