"""Dtype names a hardware profile gives a peak for (a module of its own: the profile and the GPU catalogue both
need it, and the profile resolves ``hardware=auto`` through the catalogue)."""

#: Dtype names a peak is given for.
DTYPES = ("bf16", "fp16", "fp32", "fp64")
