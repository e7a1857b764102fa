"""The torch optimizer behind Lightning's wrapper, for code that reads or remaps its state."""

from __future__ import annotations

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (or the optimizer itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
