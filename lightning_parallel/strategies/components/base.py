"""The interface of a component: the points where the engine hands control to a parallelism."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost


class Component:
    """One kind of parallelism (or memory technique) inside the engine, which it sees as an
    :class:`~lightning_parallel.strategies.host.EngineHost`.

    The engine owns launch, the process group, the mesh and Lightning's hooks. At each of these points it
    calls every component, in its fixed order; each method here is a no-op by default:

    * :meth:`validate` — in the launching process, before any worker starts: refuse what cannot run.
    * :meth:`prepare` — at the start of ``setup``, before the module gets its dtype and device.
    * :meth:`apply` — in ``setup``: transform the module (the TP plan, the pipeline, checkpointing, DDP/FSDP2).
    * :meth:`around_step` / :meth:`around_backward` — wrap a step hook or training's backward (or run it).
    * :meth:`gradient_sync_blocked` — the context of accumulated micro-batches that must not reduce gradients.
    * :meth:`after_backward` — after each backward (partial sums; gradient rounds after the last micro-batch).
    * :meth:`around_optimizer_step` — wrap the optimizer step (periodic synchronization).
    * :meth:`teardown` — undo what :meth:`apply` did to the module, where Lightning needs it undone.

    Components read the engine's public state (layout, mesh, module, optimizers, precision plugin) and
    their own config; what one component offers another (the TP plan for pipeline stages) is a method.
    """

    def __init__(self, engine: EngineHost) -> None:
        self.engine = engine

    def validate(self, layout: ParallelLayout) -> None:
        """Refuse a configuration this layout cannot run (``ValueError`` naming the option and the fix)."""

    def prepare(self, trainer: Trainer, fitting: bool) -> None:
        """Change the module before it is converted to the training dtype and moved to its device."""

    def apply(self, trainer: Trainer, fitting: bool) -> None:
        """Transform the module for this parallelism (called again by each fit/validate/test/predict)."""

    def around_step(self, hook: str, run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run (or replace) the LightningModule's ``hook`` (``training_step``, ``validation_step``, ...)."""
        return run()

    def around_backward(self, run: Callable[[], Tensor], loss: Tensor) -> Tensor:
        """Run (or replace) training's backward of ``loss``."""
        return run()

    def gradient_sync_blocked(self) -> AbstractContextManager[None]:
        """The context accumulated micro-batches (all but the last) run in."""
        return nullcontext()

    def after_backward(self, accumulating: bool) -> None:
        """After a backward; ``accumulating``: more micro-batches follow before the optimizer step."""

    def around_optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], run: Callable[[Callable[[], Any]], Any]) -> Any:
        """Run the optimizer step ``run(closure)``, possibly with another closure or work around it."""
        return run(closure)

    def on_exception(self, exception: BaseException) -> None:
        """Add what this component knows to an error's message (Lightning's ``_augment_message``)."""

    def teardown(self) -> None:
        """Undo module changes Lightning must not see after the run (wrappers, converted layers)."""
