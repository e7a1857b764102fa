"""torch.compile in the engine: each block of the trunk, after TP and checkpointing, before data parallelism.

Inside a pipeline the blocks of the traced stage modules are compiled when the stages are built (the
pipeline runner asks :meth:`CompileComponent.stage_compiler`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.parallelize.common.compile import (
    CompileConfig,
    compile_blocks,
    trunk_blocks,
)
from lightning_parallel.strategies.components.base import Component

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost


class CompileComponent(Component):
    """Compiles each layer of the model's trunk with ``torch.compile`` (``compile=true``)."""

    def __init__(self, engine: EngineHost, config: CompileConfig) -> None:
        super().__init__(engine)
        self.config = config
        self.compiled: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def apply(self, trainer: Trainer, fitting: bool) -> None:
        if not self.enabled or self.engine.layout.pipeline_parallel_size > 1:
            return
        module = self.engine.lightning_module
        self.compiled = compile_blocks(module, trunk_blocks(module), self.config)
        rank_zero_info(f"lightning_parallel: torch.compile of {len(self.compiled)} blocks ({_listing(self.compiled)})")

    def stage_compiler(self, module: nn.Module, root_name: str) -> Callable[[nn.Module], None] | None:
        """What compiles one pipeline stage's module: the trunk's blocks it holds (``None`` when off).

        Args:
            module: The whole LightningModule (before the cut).
            root_name: The module the pipeline cuts (stage modules are named relative to it).
        """
        if not self.enabled:
            return None
        prefix = f"{root_name}." if root_name else ""
        blocks = [name[len(prefix):] for name in trunk_blocks(module) if name.startswith(prefix)]

        def compile_stage(stage_module: nn.Module) -> None:
            present = {name for name, _ in stage_module.named_modules()}
            compiled = compile_blocks(stage_module, [b for b in blocks if b in present], self.config, prefix=prefix)
            self.compiled = sorted(set(self.compiled) | set(compiled))

        return compile_stage


def _listing(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f", ... {len(names) - shown} more" if len(names) > shown else "")
