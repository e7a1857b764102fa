"""A tiny regression LightningModule whose layers torch.export cannot trace (data-dependent control flow).

Used to check the pipeline's fallback: an ``nn.Sequential`` is split by slicing when tracing fails, and
anything else fails with a clear error.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class GuardedLayer(nn.Module):
    """Linear + tanh, with a data-dependent guard (never taken here) that torch.export cannot capture."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if bool((h.abs() > 1e6).any()):
            h = h.clamp(-1e6, 1e6)
        return torch.tanh(h)


class LayerLoop(nn.Module):
    """The same layers as a Sequential would hold, run by a Python loop (not an nn.Sequential)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Regressor(L.LightningModule):
    def __init__(self, width: int = 8, depth: int = 4, sequential: bool = True, lr: float = 0.05) -> None:
        super().__init__()
        layers: list[nn.Module] = [GuardedLayer(width) for _ in range(depth)] + [nn.Linear(width, 1)]
        self.net = nn.Sequential(*layers) if sequential else LayerLoop(layers)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss_synced", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class RegressionData(L.LightningDataModule):
    def __init__(self, batch_size: int, width: int = 8, samples: int = 256, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(samples, width, generator=generator, dtype=torch.float64)
        y = x.sum(dim=1, keepdim=True).sin()
        self.dataset = TensorDataset(x, y)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size)
