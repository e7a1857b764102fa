"""Context parallelism in the engine: each sequence split over the ``cp`` axis, attention as a ring.

The transform is :mod:`lightning_parallel.parallelize.context.splitter`; this component decides when it applies
(``context_parallel_size > 1``) and refuses what it cannot combine with. Blocks that activation
checkpointing recomputes in backward run under the same torch function mode again (see
:mod:`lightning_parallel.parallelize.common.activation_checkpointing`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallelize.context.splitter import SequenceSplitter
from lightning_parallel.strategies.components.base import Component

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


class ContextParallelComponent(Component):
    """Splits the sequence of every model call over the ``cp`` ranks (see :mod:`~lightning_parallel.parallelize.context.splitter`)."""

    splitter: SequenceSplitter | None = None

    @property
    def enabled(self) -> bool:
        return self.engine.layout.context_parallel_size > 1

    def validate(self, layout: ParallelLayout) -> None:
        cp = layout.context_parallel_size
        if cp == 1:
            return
        engine = self.engine
        refused = []
        if engine.compile.config.enabled:
            refused.append(("compile=True", "compile=False",
                            "a compiled block would trace the ring's per-mask plan (host reads of the mask, a Python "
                            "loop over ring steps and chunk layouts that change with the documents) into its graph"))
        if engine.data_parallel.sync.is_periodic:
            refused.append((f"sync={engine.data_parallel.sync.method!r}", "sync='every_step'",
                            "context-parallel peers compute one sequence together and must hold the same weights "
                            "every step, while periodic sync lets each rank's weights drift until the next sync"))
        if refused:
            found = ", ".join(name for name, _, _ in refused)
            fixes = ", ".join(fix for _, fix, _ in refused)
            why = "; ".join(f"{name}: {reason}" for name, _, reason in refused)
            raise ValueError(
                f"context_parallel_size={cp} does not combine with {found} yet ({why}). Set {fixes}, or "
                "context_parallel_size=1."
            )

    def apply(self, trainer: Trainer, fitting: bool) -> None:
        if not self.enabled or self.splitter is not None or self.engine.layout.pipeline_parallel_size > 1:
            return  # (a pipeline splits the sequence of its model call itself: components/pipeline)
        engine = self.engine
        # A loss_parallel head's vocabulary-sharded logits are gathered over the sequence as DTensors (splitter).
        cp_mesh = engine.device_mesh["cp"]
        self.splitter = SequenceSplitter(
            engine.lightning_module, cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
        )

    def around_step(self, hook: str, run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.splitter is not None:
            engine = self.engine
            # Lightning calls a wrapped model (DDP) with the step's batch, and the wrapper calls the
            # LightningModule once before the step runs: that call is not the model call.
            self.splitter.skip_root_calls = int(engine.model is not engine.lightning_module)
        return run()

    def teardown(self) -> None:
        if self.splitter is not None:
            self.splitter.remove()
            self.splitter = None
