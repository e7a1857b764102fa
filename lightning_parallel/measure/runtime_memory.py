"""C-allocator memory the training runtime and a pipeline's tracing runtime add to each process, measured once per
machine.

A process that trains allocates some buffers of its own on its first steps (the autograd engine, operator caches,
Lightning's loop); cutting a model into pipeline stages traces it (``torch.export``, FX graphs, symbolic shapes) and
keeps MiB more for the run. Where a device's memory is the host's (a CPU), that is memory a rank needs beside its
tensors; on a GPU it is host memory and costs the device nothing. Both are measured in a fresh process (an import
already done by the caller would hide them), after the imports a training run has made before its first batch, as
the growth of the bytes the C allocator has handed out (:func:`~lightning_parallel.measure.peak_memory.allocated_bytes`,
what the ScalingMonitor measures on a CPU) less the tensors the process then holds: the training runtime over a
Lightning fit of a few steps of a small two-block transformer with AdamW (Lightning's default logger and progress
bar on, as in a user's run), the pipeline runtime while that model, trained, is traced into two stages and run
(:func:`runtime_bytes`).
"""

from __future__ import annotations

import gc
import subprocess
import sys

import torch
from torch import nn

from lightning_parallel.measure.environment import standalone_environment
from lightning_parallel.measure.peak_memory import allocated_bytes, held_tensor_bytes


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


def _allocated() -> int:
    gc.collect()
    return allocated_bytes() or 0


def _fit(model: nn.Module, tokens: torch.Tensor, directory: str) -> torch.optim.Optimizer:
    """A few Lightning training steps of ``model`` on ``tokens``; the optimizer it trained with."""
    import lightning as L

    class _Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            logits = self.model(batch[0])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[0].flatten())
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens.repeat(5, 1)), batch_size=len(tokens))
    trainer = L.Trainer(max_steps=5, accelerator="cpu", devices=1, default_root_dir=directory, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(_Module(), data)
    return trainer.optimizers[0]


def _measure_in_this_process() -> tuple[int, int]:
    """(training runtime, pipeline runtime) this process grew by, in bytes."""
    import tempfile

    import lightning  # noqa: F401  what a training run has imported before its first batch
    import torch.distributed  # noqa: F401
    from torch.distributed.pipelining import SplitPoint, pipeline

    model = nn.Sequential(nn.Embedding(64, 32), _Block(), _Block(), nn.LayerNorm(32), nn.Linear(32, 64))
    tokens = torch.randint(0, 64, (2, 16))
    before = _allocated() - held_tensor_bytes(model)
    with tempfile.TemporaryDirectory(prefix="lightning-parallel-runtime-") as directory:
        optimizer = _fit(model, tokens, directory)
    state = sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    gradients = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    trained = _allocated()
    training = trained - held_tensor_bytes(model) - state - gradients - before
    # torch's pipeline frontend, as the strategies cut a model (parallelize/pipeline/build.py)
    pipe = pipeline(model, (tokens,), split_spec={"2": SplitPoint.BEGINNING})
    pipe(tokens)[0].sum().backward()  # the stages' generated code run once, forward and backward
    traced = _allocated() - trained
    del pipe
    return max(training, 0), max(traced, 0)


def runtime_bytes() -> dict[str, float]:
    """What training, and tracing a pipeline besides, add to a fresh process's memory on this machine (bytes):
    ``{"training": ..., "pipeline": ...}``, both 0 where the allocator's figures cannot be read."""
    if allocated_bytes() is None:
        return {"training": 0.0, "pipeline": 0.0}
    # Measured alone even when a rank of a launched job asks (the hardware profile is measured at a job's start).
    done = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True, timeout=300, check=False,
                          env=standalone_environment())
    if done.returncode != 0:
        raise RuntimeError(f"Measuring the training runtime's memory failed:\n{done.stderr[-2000:]}")
    training, traced = done.stdout.strip().splitlines()[-1].split()
    return {"training": float(training), "pipeline": float(traced)}


if __name__ == "__main__":
    print(*_measure_in_this_process())
