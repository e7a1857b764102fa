"""This machine's dense matmul peak, measured (for MFU on a CPU, where no datasheet gives one)."""

from __future__ import annotations

import time
from functools import cache

import torch

#: Dtype names (as hardware profiles give them) and their torch dtypes.
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


@cache
def measured_matmul_tflops(dtype: str, size: int = 512, seconds: float = 0.3) -> float:
    """Dense matmul TFLOP/s of this process with its current threads, measured once per dtype.

    A ``size × size`` matmul repeated for about ``seconds`` after a warm-up; the best of three rounds.
    """
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(TORCH_DTYPES[dtype])
    b = a.clone()
    a @ b  # warm-up (thread pool, kernels)
    best = 0.0
    for _ in range(3):
        repeats, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 3:
            a @ b
            repeats += 1
        best = max(best, 2 * size**3 * repeats / (time.perf_counter() - start))
    return best / 1e12
