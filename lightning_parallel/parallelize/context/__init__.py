"""Context parallelism: each sequence split across the ``cp`` ranks, attention as a ring.

:mod:`.sequence` (the head-tail split and the differentiable gather), :mod:`.splitter` (the split at the
model call and the torch function mode that makes the model see whole-sequence positions), :mod:`.ops` (ops
along the sequence: global cumsum/diff, masks turned causal, refusals), :mod:`.ring_attention` (torch's ring
kernels behind SDPA's signature).
"""
