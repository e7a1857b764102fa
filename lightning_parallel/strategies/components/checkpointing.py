"""Activation checkpointing in the engine: chosen blocks recompute their activations in backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel.parallelize.common.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpoint_targets,
    normalize_patterns,
)
from lightning_parallel.strategies.components.base import Component

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost


class ActivationCheckpointingComponent(Component):
    """Wraps the blocks that ``patterns`` name (``"auto"``: each layer of the trunk) in checkpointing.

    After tensor parallelism and before data parallelism, so FSDP2 units and DDP see the wrapped blocks.
    Inside a pipeline the stages are wrapped after the cut, by the pipeline (it reads :attr:`patterns`).
    """

    def __init__(self, engine: EngineHost, patterns: str | Sequence[str] | None) -> None:
        super().__init__(engine)
        self.patterns = normalize_patterns(patterns)
        self.checkpointed: list[str] | None = None

    def apply(self, trainer: Trainer, fitting: bool) -> None:
        if not self.patterns or self.checkpointed is not None or self.engine.layout.pipeline_parallel_size > 1:
            return
        module = self.engine.lightning_module
        self.checkpointed = apply_activation_checkpointing(module, checkpoint_targets(module, self.patterns))
        rank_zero_info(f"lightning_parallel: activation checkpointing of {', '.join(self.checkpointed)}")
