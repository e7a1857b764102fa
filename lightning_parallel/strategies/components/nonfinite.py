"""Non-finite losses and gradients seen by every rank at once: stop with the culprit, or skip the step everywhere."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_parallel import collectives
from lightning_parallel.strategies.components.base import Component
from lightning_parallel.strategies.collectives import is_dry_run
from lightning_parallel.strategies.precision import active_grad_scaler, agree_found_inf

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost

#: What to do when a loss or gradient holds NaN or Inf on any rank.
NONFINITE_MODES: dict[str, str] = {
    "error": "stop with the step, the ranks and which tensor (the default)",
    "skip": "skip that optimizer step on every rank (its gradients dropped; counted in the summary)",
}

#: The rows of the flags every rank contributes to (one column per rank).
_KINDS = ("loss", "gradients")


class NonFiniteGuard(Component):
    """After the last micro-batch's backward, every rank says whether its loss and gradients are finite.

    One all-reduce per optimizer step of a ``[2, world size]`` flags tensor (each rank sets its own column, MAX
    combines them) and one read of it on the host, so all ranks decide alike: under ``skip`` replicas never drift
    apart (one skipping while another steps), under ``error`` every rank stops at the same step and the message
    names the ranks where it happened. The flags are computed on the device (one ``foreach`` norm per gradient
    dtype), so nothing waits for the device per gradient.

    Why a column per rank rather than two numbers (the lowest bad rank, a count): the message can name every
    culprit, and 2 x world int32s are nothing next to the step's gradients (64 KiB at 8,192 ranks) while still
    one collective.

    Under a gradient scaler (``precision="16-mixed"``) overflowing gradients are the scaler's business: it lowers
    the scale and skips the step (the closure this guard wraps runs before the scaler unscales, so a scaled
    gradient's inf is no verdict yet). The guard then judges the loss only, and makes the scaler agree on its
    found-inf over the world (:class:`~lightning_parallel.strategies.precision.WorldGradScaler`), so that one
    shard's overflow skips the step, and lowers the scale, on every rank. Lightning's order is then: scale the
    loss, backward, this guard (the loss), unscale (the gradients judged, the verdict agreed), clip, step or skip.
    """

    def __init__(self, engine: EngineHost, mode: str) -> None:
        super().__init__(engine)
        if mode not in NONFINITE_MODES:
            raise ValueError(f"nonfinite={mode!r} is unknown; choose one of {', '.join(NONFINITE_MODES)}.")
        self.mode = mode
        self.skipped_steps = 0

    def apply(self, trainer: Trainer, fitting: bool) -> None:
        if fitting:
            agree_found_inf(self.engine.precision_plugin)

    def around_optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], run: Callable[[Callable[[], Any]], Any]) -> Any:
        def checked_closure() -> Any:
            result = closure()
            skipped = self._check(result, optimizer)
            if skipped and active_grad_scaler(self.engine.precision_plugin) is not None:
                # Lightning's mixed precision skips unscaling, the scaler's step and its update when the closure
                # returns None (a scaler fails on an optimizer without gradients, and a bad loss is no overflow).
                return None
            return result

        return run(checked_closure)

    def _check(self, loss: Any, optimizer: Optimizer) -> bool:
        """Judge this step on every rank at once; ``True`` where the step is to be skipped (``skip`` mode)."""
        engine = self.engine
        device = engine.root_device
        bad_loss = _nonfinite([loss.detach()], device) if isinstance(loss, Tensor) else torch.zeros((), dtype=torch.bool, device=device)
        if active_grad_scaler(engine.precision_plugin) is None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            bad_grads = _nonfinite(grads, device)
        else:  # the scaler judges them once unscaled, agreed over the world
            bad_grads = torch.zeros((), dtype=torch.bool, device=device)
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        flags = torch.zeros(len(_KINDS), world, dtype=torch.int32, device=device)
        flags[:, rank] = torch.stack([bad_loss, bad_grads]).to(torch.int32)
        if dist.is_initialized():
            collectives.all_reduce(flags, op=collectives.MAX)
        culprits = _culprits(flags.tolist())  # the one host read of the step's judgement
        if not any(culprits.values()) or is_dry_run():  # a dry run's values are whatever fake collectives left
            return False
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
        return True


def _nonfinite(tensors: list[Tensor], device: torch.device) -> Tensor:
    """A 0-dim bool on ``device``: whether any of ``tensors`` (their local parts) holds NaN or Inf, computed without
    reading anything back to the host."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel():  # the inf norm of nothing is an error, and nothing is finite
            by_kind[(local.device, local.dtype)].append(local.detach())
    verdicts = [torch.zeros((), dtype=torch.bool, device=device)]
    for group in by_kind.values():
        # The largest |x| of each tensor is NaN or Inf exactly when the tensor holds one (it overflows nothing, and
        # NaN propagates through the max). torch._foreach_norm is private (checked against torch 2.13): one kernel
        # per device and dtype on CUDA, where isfinite(...).all() per tensor launches two each.
        norms = torch._foreach_norm(group, float("inf"))
        verdicts.append(~torch.isfinite(torch.stack(norms)).all().to(device))
    return torch.stack(verdicts).any()


def _culprits(flags: list[list[int]]) -> dict[str, list[int]]:
    """The ranks that reported each kind of non-finite value, from the all-reduced ``[kinds, world]`` flags."""
    return {kind: [rank for rank, flag in enumerate(row) if flag] for kind, row in zip(_KINDS, flags)}
