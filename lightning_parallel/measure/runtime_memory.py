"""Host memory a pipeline's tracing runtime adds to each process, measured once per machine.

Cutting a model into pipeline stages traces it (``torch.export``, FX graphs, symbolic shapes): the first trace loads
code and builds objects that stay resident for the run, tens of MiB whatever the model's size. Where a device's
memory is the host's (a CPU), that is memory a rank needs beside its tensors; on a GPU it is host memory and costs the
device nothing. :func:`pipeline_runtime_bytes` measures it in a fresh process (an import already done by the caller
would hide it): the growth of the resident set while a small two-block transformer is traced into two stages and run once, after
the imports a training run has made before its first batch.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

_STATUS = Path("/proc/self/status")


def _resident_bytes() -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class _Block(nn.Module):
    """A pre-norm transformer block of the usual operators (attention through SDPA, an MLP)."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm_1, self.norm_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm_1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm_2(x))


def _measure_in_this_process() -> int:
    """Resident growth of this process while a small model is traced into two stages (bytes)."""
    import lightning  # noqa: F401  what a training run has imported before its first batch
    import torch.distributed  # noqa: F401
    from torch.distributed.pipelining import SplitPoint, pipeline

    model = nn.Sequential(nn.Embedding(64, 32), _Block(), _Block(), nn.LayerNorm(32), nn.Linear(32, 64))
    tokens = torch.randint(0, 64, (2, 16))
    gc.collect()
    before = _resident_bytes()
    # torch's pipeline frontend, as the strategies cut a model (parallelize/pipeline/build.py)
    pipe = pipeline(model, (tokens,), split_spec={"2": SplitPoint.BEGINNING})
    pipe(tokens)[0].sum().backward()  # the stages' generated code run once, forward and backward
    gc.collect()
    grown = _resident_bytes() - before
    del pipe
    return max(grown, 0)


def pipeline_runtime_bytes() -> float:
    """What tracing a pipeline adds to a fresh process's resident memory on this machine (bytes; 0 where the
    resident set cannot be read)."""
    if not _STATUS.exists():
        return 0.0
    done = subprocess.run(
        [sys.executable, "-m", __name__], capture_output=True, text=True, timeout=300, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"Measuring the pipeline runtime's memory failed:\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(_measure_in_this_process())
