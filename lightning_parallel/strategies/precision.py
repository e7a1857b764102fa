"""Lightning precision settings translated for the engines under the strategies."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lightning_parallel import collectives

#: Lightning's mixed-precision names and the dtype their compute runs in.
_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def fsdp_mixed_precision(plugin: Precision, gathered: bool = True) -> MixedPrecisionPolicy:
    """FSDP2's policy for Lightning's ``precision`` setting.

    Under ``bf16-mixed``/``16-mixed`` sharded parameters are gathered in the low-precision dtype (half the
    all-gather bytes; the ops then compute with bf16 copies of the float32 weights: norms and embeddings too,
    where autocast would have kept float32) while gradients are reduced and kept in float32, as the master
    weights are. ``*-true`` and ``32``/``64`` keep every tensor in the module's dtype.

    Args:
        plugin: Lightning's precision plugin.
        gathered: Whether FSDP2 gathers the parameters from other ranks. Replicas of tensor-parallel shards run
            FSDP2 on shards of one rank (DDP cannot take DTensors): nothing to halve, so their parameters stay
            float32 and autocast casts them per op, as DDP and one device do.
    """
    dtype = _MIXED.get(str(getattr(plugin, "precision", "")))
    if dtype is None or not gathered:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


class WorldGradScaler(torch.amp.GradScaler):
    """torch's ``GradScaler`` whose found-inf is agreed over every rank of the world before the step uses it.

    Each rank holds other gradients (tensor-parallel and FSDP shards, pipeline stages, divided experts), so an
    fp16 overflow shows on some ranks only. torch's scaler would skip the step and lower the scale there and
    step on the others: the ranks' parameters and scales part ways. Here the flag of each unscale is reduced
    (MAX) over the world in one all-reduce, whatever the number of gradients; DTensor gradients are unscaled
    through their local tensors (torch's own DTensor path reduces a flag per device and dtype over the
    gradient's mesh, and refuses lists mixing DTensor and plain gradients, as tensor parallelism leaves them).
    ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` does the same over one group but goes through
    DTensor dispatch and calls ``torch.distributed`` itself.
    """

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        # GradScaler._unscale_grads_ is private (checked against torch 2.13): the method ShardedGradScaler overrides
        # too, called by unscale_() and by step() for optimizers that unscale themselves (fused ones).
        grads: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if grad.is_sparse:  # as torch does: check the coalesced values (duplicates summed)
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        local = grad._values()
                    else:
                        local = grad.to_local() if isinstance(grad, DTensor) else grad
                    grads[(local.device, local.dtype)].append(local)
            found_on: dict[torch.device, Tensor] = {found_inf.device: found_inf}
            for (device, _), tensors in grads.items():
                found = found_on.setdefault(device, torch.zeros_like(found_inf, device=device))
                # torch._amp_foreach_non_finite_check_and_unscale_ is private (checked against torch 2.13): the
                # kernel GradScaler runs; one launch per device and dtype.
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale.to(device))
            for device, found in found_on.items():
                if device != found_inf.device:
                    torch.maximum(found_inf, found.to(found_inf.device), out=found_inf)
        if dist.is_initialized():
            # Every rank reaches this once per unscale, with gradients or without (an empty stage still votes).
            collectives.all_reduce(found_inf, op=collectives.MAX)
        return {found_inf.device: found_inf}


def active_grad_scaler(plugin: Precision) -> torch.amp.GradScaler | None:
    """The plugin's gradient scaler when one is in use (``precision="16-mixed"``), else ``None``."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None


def agree_found_inf(plugin: Precision) -> None:
    """Give the plugin a :class:`WorldGradScaler` in place of torch's own (its settings and state carried over).

    Lightning builds ``precision="16-mixed"`` with a plain ``GradScaler``; a scaler of another class (the
    user's own) is left as it is, with a warning that its ranks may disagree on skipping a step.
    """
    scaler = active_grad_scaler(plugin)
    if scaler is None or isinstance(scaler, WorldGradScaler):
        return
    if type(scaler) not in (torch.amp.GradScaler, torch.cuda.amp.GradScaler):
        rank_zero_warn(
            f"lightning_parallel: the precision plugin's {type(scaler).__name__} is kept as given; unless it agrees on "
            "found infs over every rank, an fp16 overflow on one rank's gradients skips the step there only. Leave "
            "the scaler to the strategy (MixedPrecision('16-mixed', device)) or use lightning_parallel's WorldGradScaler."
        )
        return
    device = getattr(plugin, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    agreed = WorldGradScaler(device=str(device))
    agreed.load_state_dict(scaler.state_dict())  # scale, growth/backoff factors, interval, growth tracker
    plugin.scaler = agreed
