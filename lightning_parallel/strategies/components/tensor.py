"""Tensor parallelism in the engine: the plan applied to the whole module, or handed to pipeline stages."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import _augment_message
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_parallel.collectives import sync_module_states
from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallelize.expert.experts import find_routed_experts
from lightning_parallel.parallelize.common.expert_lists import find_expert_lists
from lightning_parallel.parallelize.tensor.sequence import reduce_partial_gradients
from lightning_parallel.parallelize.tensor.split_region import reduce_split_region_gradients
from lightning_parallel.parallelize.pipeline.stage_tensor import StageTensorParallel
from lightning_parallel.parallelize.tensor.apply import (
    TensorParallelConfig,
    apply_tensor_parallel,
    check_plan,
)
from lightning_parallel.strategies.collectives import whole
from lightning_parallel.strategies.components.base import Component

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost


class TensorParallelComponent(Component):
    """Splits layers over the ``tp`` axis (with sequence parallelism and a ``loss_parallel`` head).

    Without a pipeline the plan is applied to the whole module in :meth:`apply`; with one, each stage is
    split after the cut through :meth:`stage_plan`.
    """

    def __init__(self, engine: EngineHost, config: TensorParallelConfig) -> None:
        super().__init__(engine)
        self.config = config
        self.loss_parallel = False  # the head keeps vocabulary-sharded logits in training_step
        self._split_module: nn.Module | None = None

    @property
    def enabled(self) -> bool:
        return self.engine.layout.tensor_parallel_size > 1

    def validate(self, layout: ParallelLayout) -> None:
        if layout.pipeline_parallel_size > 1 and layout.tensor_parallel_size > 1 and self.config.sequence_parallel:
            raise ValueError(
                "sequence_parallel=True is not supported with pipeline_parallel_size > 1 (traced stages run in DTensor's "
                "global view, without the sequence-sharded regions); set sequence_parallel=False."
            )

    def apply(self, trainer: Trainer, fitting: bool) -> None:
        module = self.engine.lightning_module
        # Pipeline stages are split after the cut (stage_plan); fit() then validate()/test() set up again:
        # the module is already split (and stays split).
        if not self.enabled or self.engine.layout.pipeline_parallel_size > 1 or module is self._split_module:
            return
        size = self.engine.layout.tensor_parallel_size
        resolved = self.config.resolve(module, warn=rank_zero_warn, tp_size=size, exclude=self._experts_elsewhere(module))
        check_plan(module, resolved, size)
        # Neither TP (outside the split layers) nor FSDP2 copies weights between ranks: start every rank
        # from rank 0's weights, as DDP would, even if the module was not built from one seed everywhere.
        if not self.engine.placement.deferred:  # a meta module gets the same values on every rank when placed
            sync_module_states(module)
        apply_tensor_parallel(module, self.engine.device_mesh["tp"], resolved, self.config.sequence_parallel)
        self._split_module = module
        if "loss_parallel" in resolved.styles.values():
            self.loss_parallel = True
            _log_whole_values(module)
        sequence = " with sequence parallelism" if self.config.sequence_parallel else ""
        rank_zero_info(f"lightning_parallel: tensor-parallel plan over tp={size}{sequence}:\n{resolved.describe()}")

    def _experts_elsewhere(self, module: nn.Module) -> tuple[str, ...]:
        """The routed-experts modules and nn.ModuleList experts that expert parallelism divides (the plan leaves
        them whole)."""
        if not self.engine.expert_parallel.enabled:
            return ()
        fused = tuple(fqn for fqn, found in find_routed_experts(module).items() if not isinstance(found, str))
        return fused + tuple(find_expert_lists(module))

    def stage_plan(self, root_name: str) -> StageTensorParallel:
        """The plan for the pipeline stages of ``root_name`` (resolved on the whole module, before the cut)."""
        module = self.engine.lightning_module
        size = self.engine.layout.tensor_parallel_size
        elsewhere = self._experts_elsewhere(module)
        resolved = self.config.resolve(module, warn=rank_zero_warn, tp_size=size, exclude=elsewhere)
        check_plan(module, resolved, size)
        rank_zero_info(f"lightning_parallel: tensor-parallel plan over tp={size} inside each stage:\n{resolved.describe()}")
        # Experts divided over ep stay plain tensors in the stages (expert parallelism places them on its own mesh).
        return StageTensorParallel.from_plan(resolved, root_name, self.engine.device_mesh["tp"], owned_elsewhere=elsewhere)

    def around_step(self, hook: str, run: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Under a loss_parallel head, F.cross_entropy on vocabulary-sharded logits must run (and be
        # differentiated) inside torch's loss_parallel(); what the step returns becomes ordinary tensors.
        if hook != "training_step" or not self.loss_parallel:
            return run()
        with loss_parallel():
            return apply_to_collection(run(), DTensor, whole)

    def around_backward(self, run: Callable[[], Tensor], loss: Tensor) -> Tensor:
        with loss_parallel() if self.loss_parallel else nullcontext():
            return run()

    def after_backward(self, accumulating: bool) -> None:
        # After the last micro-batch only: sequence-parallel norms leave partial-sum gradients.
        # Replicated parameters used on a rank's heads only (per-head norms) leave partial sums over the tp group.
        if self.enabled and not accumulating:
            reduce_partial_gradients(self.engine.lightning_module.parameters())
            reduce_split_region_gradients(self.engine.lightning_module)

    def on_exception(self, exception: BaseException) -> None:
        if self.loss_parallel:
            _augment_message(
                exception,
                pattern=".*mixed torch.Tensor and DTensor.*",
                new_message=(
                    "The output head uses the 'loss_parallel' style: in training_step its output is a DTensor "
                    "sharded over the vocabulary and may only be passed to F.cross_entropy. Compute anything else "
                    "from the logits in validation_step, or give the head the 'colwise' or 'replicate' style."
                ),
            )


def _log_whole_values(module: LightningModule) -> None:
    """Make ``module.log`` turn DTensor values (a loss_parallel loss) into ordinary tensors first."""
    original = module.log

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        original(name, apply_to_collection(value, DTensor, whole), *args, **kwargs)

    # An instance attribute: the class, and log_dict (which calls self.log), stay as they are.
    module.log = log
