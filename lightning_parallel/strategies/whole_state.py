"""Checkpoint hooks of the engine: whole (unsharded) tensors in and out when parameters are split."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

from lightning_parallel.checkpoint import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)


class WholeTensorCheckpointMixin:
    """Lightning's state hooks for a strategy with ``_is_sharded``, ``lightning_module`` and ``optimizers``:
    when parameters are DTensors every rank takes part and the checkpoint holds ordinary tensors, so a
    file saved under tensor parallelism loads into the plain module (mixed into the engine)."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Sharded parameters are gathered so the file holds ordinary tensors (every rank takes part).
        if self._is_sharded:
            return full_model_state(self.lightning_module)
        return super().lightning_module_state_dict()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._is_sharded:
            load_full_model_state(self.lightning_module, checkpoint["state_dict"], strict=strict)
        else:
            super().load_model_state_dict(checkpoint, strict=strict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._is_sharded:
            return full_optimizer_state(self.lightning_module, _unwrap_optimizer(optimizer))
        return super().optimizer_state(optimizer)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._is_sharded:
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            load_full_optimizer_state(self.lightning_module, _unwrap_optimizer(optimizer), state)


def _unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
