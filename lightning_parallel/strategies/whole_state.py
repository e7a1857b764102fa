"""Checkpoint hooks of the engine: whole tensors in and out when parameters are split or staged.

Under tensor parallelism every rank takes part and the checkpoint holds ordinary tensors; under pipeline
parallelism each stage's part is gathered, so the file always loads into the plain module. Optimizer
state is keyed by parameter names there, which any layout can read back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

from lightning_parallel.checkpoint import (
    full_model_state,
    full_optimizer_state,
    gather_pipeline_parts,
    is_named_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    load_into_stages,
    local_named_optimizer_state,
    named_optimizer_state,
)
from lightning_parallel.strategies.collectives import whole


class WholeTensorCheckpointMixin:
    """Lightning's state hooks for a strategy with ``parameters_are_dtensors``, ``pipeline_parallel``, ``pipeline_runner``,
    ``device_mesh``, ``lightning_module`` and ``optimizers`` (mixed into the engine)."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.pipeline_parallel.staged:
            # Tensor-parallel stages hold DTensors: gathered over tp first (every rank takes part).
            local = {k: whole(v).detach().cpu() for k, v in self.lightning_module.state_dict().items()}
            return gather_pipeline_parts(local, self.device_mesh["pp"].get_group())
        if self.parameters_are_dtensors:
            # Sharded parameters are gathered so the file holds ordinary tensors (every rank takes part).
            return full_model_state(self.lightning_module)
        return super().lightning_module_state_dict()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.pipeline_parallel.staged:
            load_into_stages(self.lightning_module, checkpoint["state_dict"], self.pipeline_runner.whole_shapes, strict=strict)
        elif self.parameters_are_dtensors:
            load_full_model_state(self.lightning_module, checkpoint["state_dict"], strict=strict)
        else:
            super().load_model_state_dict(checkpoint, strict=strict)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.pipeline_parallel.staged:
            local = named_optimizer_state(self.lightning_module, unwrap_optimizer(optimizer))
            return gather_pipeline_parts(local, self.device_mesh["pp"].get_group())
        if self.parameters_are_dtensors:
            return full_optimizer_state(self.lightning_module, unwrap_optimizer(optimizer))
        return super().optimizer_state(optimizer)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        named = all(is_named_optimizer_state(s) for s in states)
        if self.pipeline_parallel.staged:
            if not named:
                raise RuntimeError(
                    "This checkpoint's optimizer state is keyed by position, which cannot be matched to a model already "
                    "cut into pipeline stages: pass ckpt_path to the first fit/validate/test/predict call of the Trainer."
                )
            names = {name for name, _ in self.lightning_module.named_parameters()}
            states = [local_named_optimizer_state(s, names) for s in states]
        elif not self.parameters_are_dtensors and not named:
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, state in zip(self.optimizers, states):
            load_full_optimizer_state(self.lightning_module, unwrap_optimizer(optimizer), state)


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (or the optimizer itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
