"""Non-finite losses and gradients seen by every rank at once: stop with the culprit, or skip the step everywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_parallel.strategies.components.base import Component
from lightning_parallel.strategies.collectives import is_dry_run

if TYPE_CHECKING:
    from lightning_parallel.strategies.host import EngineHost

#: What to do when a loss or gradient holds NaN or Inf on any rank.
NONFINITE_MODES: dict[str, str] = {
    "error": "stop with the step, the ranks and which tensor (the default)",
    "skip": "skip that optimizer step on every rank (its gradients dropped; counted in the summary)",
}


class NonFiniteGuard(Component):
    """After the last micro-batch's backward, every rank says whether its loss and gradients are finite.

    One all-gather of two numbers per rank per optimizer step, so all ranks decide alike: under ``skip``
    replicas never drift apart (one skipping while another steps), under ``error`` every rank stops at
    the same step and the message names the ranks where it happened.
    """

    def __init__(self, engine: EngineHost, mode: str) -> None:
        super().__init__(engine)
        if mode not in NONFINITE_MODES:
            raise ValueError(f"nonfinite={mode!r} is unknown; choose one of {', '.join(NONFINITE_MODES)}.")
        self.mode = mode
        self.skipped_steps = 0

    def around_optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], run: Callable[[Callable[[], Any]], Any]) -> Any:
        def checked_closure() -> Any:
            result = closure()
            self._check(result, optimizer)
            return result

        return run(checked_closure)

    def _check(self, loss: Any, optimizer: Optimizer) -> None:
        engine = self.engine
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        bad_loss = isinstance(loss, Tensor) and not bool(torch.isfinite(_local(loss.detach())).all())
        bad_grads = not all(bool(torch.isfinite(_local(g)).all()) for g in grads)
        flags = torch.tensor([int(bad_loss), int(bad_grads)], device=engine.root_device)
        if dist.is_initialized():
            gathered = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, flags)
        else:
            gathered = [flags]
        culprits = {kind: [rank for rank, f in enumerate(gathered) if f[i]] for i, kind in enumerate(("loss", "gradients"))}
        if not any(culprits.values()) or is_dry_run():  # a dry run's values are whatever fake collectives left
            return
        step = engine.lightning_module.trainer.global_step
        where = "; ".join(f"{kind} on rank(s) {ranks}" for kind, ranks in culprits.items() if ranks)
        if self.mode == "error":
            raise RuntimeError(
                f"Non-finite values (NaN or Inf) at optimizer step {step}: {where}. Lower the learning rate, clip "
                "gradients (trainer.gradient_clip_val), check the data of that step, or pass nonfinite='skip' to "
                "skip such steps on every rank."
            )
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None  # torch's optimizers leave parameters without a gradient untouched
        self.skipped_steps += 1
        rank_zero_warn(f"lightning_parallel: skipped optimizer step {step} on every rank: non-finite {where}.")


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
