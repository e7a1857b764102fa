"""Less synchronous data parallelism: local SGD (post-local SGD) and DiLoCo. No Lightning here.

- ``every_step`` (default): gradients averaged before every optimizer step (DDP). Exact: equals one
  device on the global batch, and every step waits for the slowest replica.
- ``local_sgd``: after ``warmup_steps`` synchronous steps, each replica steps on its own gradients and the
  replicas average their *parameters* every ``sync_every`` steps (one all-reduce per period instead of one
  per step: post-local SGD). ``sync_every=1`` is synchronous SGD and runs as ``every_step``.
- ``diloco``: the inner optimizer (the module's own) steps locally for ``sync_every`` steps; then the
  replicas' mean parameters give a pseudo-gradient θ_outer − mean(θ_local), on which an outer SGD
  (Nesterov momentum by default) steps θ_outer; every replica restarts from θ_outer.

Parameter averaging uses torch's ``model_averaging.utils.average_parameters`` (one flat all-reduce).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters

SYNC_METHODS: dict[str, str] = {
    "every_step": "gradients averaged before every optimizer step (exact; waits for the slowest replica)",
    "local_sgd": "local steps, parameters averaged every sync_every steps (after sync_warmup_steps synchronous ones)",
    "diloco": "inner optimizer locally for sync_every steps, outer Nesterov SGD on the averaged pseudo-gradient",
}


@dataclass(frozen=True)
class SyncConfig:
    """How often data-parallel replicas synchronize, and how.

    Args:
        method: One of :data:`SYNC_METHODS`.
        sync_every: Optimizer steps between synchronizations (``local_sgd``, ``diloco``).
        warmup_steps: ``local_sgd``: synchronous steps (gradients averaged) before the local ones.
        outer_lr: ``diloco``: learning rate of the outer optimizer.
        outer_momentum: ``diloco``: its momentum (0 for none).
        outer_nesterov: ``diloco``: Nesterov momentum (needs ``outer_momentum > 0``).
    """

    # The presets' flat keywords (strategies/options.py).
    method: str = field(default="every_step", metadata={"option": "sync"})
    sync_every: int = 1
    warmup_steps: int = field(default=0, metadata={"option": "sync_warmup_steps"})
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True

    def __post_init__(self) -> None:
        if self.method not in SYNC_METHODS:
            raise ValueError(f"sync={self.method!r} is unknown. Choose one of: {', '.join(SYNC_METHODS)}.")
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"sync_every={self.sync_every!r} must be an int >= 1 (optimizer steps between synchronizations).")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"sync_warmup_steps={self.warmup_steps!r} must be an int >= 0.")
        if self.method == "every_step" and (self.sync_every != 1 or self.warmup_steps != 0):
            raise ValueError(
                f"sync='every_step' synchronizes every step; sync_every={self.sync_every} and sync_warmup_steps="
                f"{self.warmup_steps} apply to sync='local_sgd' or 'diloco'. Pick one of those, or drop the options."
            )
        if self.method == "diloco":
            if not self.outer_lr > 0:
                raise ValueError(f"outer_lr={self.outer_lr!r} must be positive (the outer optimizer's learning rate).")
            if not 0 <= self.outer_momentum < 1:
                raise ValueError(f"outer_momentum={self.outer_momentum!r} must be in [0, 1).")
            if self.outer_nesterov and self.outer_momentum == 0:
                raise ValueError("outer_nesterov=True needs outer_momentum > 0; set outer_nesterov=false for plain outer SGD.")

    @property
    def is_periodic(self) -> bool:
        """Whether replicas step on local gradients (no per-step gradient all-reduce at all times)."""
        return self.method == "diloco" or (self.method == "local_sgd" and self.sync_every > 1)


class PeriodicSync:
    """Synchronizes replicas around their optimizer steps as :class:`SyncConfig` says.

    Args:
        config: The method and its period.
        parameters: This replica's parameters (all replicas pass theirs in the same order).
        group: The data-parallel process group.
    """

    def __init__(self, config: SyncConfig, parameters: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
        if not config.is_periodic:
            raise ValueError(f"sync={config.method!r} with sync_every={config.sync_every} synchronizes every step: use DDP.")
        self.config = config
        self.parameters = [p for p in parameters if p.requires_grad]
        self.group = group
        self.outer_parameters: list[Tensor] = []
        self.outer_optimizer: torch.optim.SGD | None = None
        if config.method == "diloco":
            self.outer_parameters = [p.detach().clone() for p in self.parameters]
            self.outer_optimizer = torch.optim.SGD(
                self.outer_parameters, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.outer_nesterov
            )

    def averages_gradients(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based) averages gradients first (local SGD's warm-up)."""
        return self.config.method == "local_sgd" and step < self.config.warmup_steps

    def syncs_after(self, steps_done: int) -> bool:
        """Whether the replicas synchronize right after ``steps_done`` optimizer steps."""
        if self.config.method == "local_sgd":
            local = steps_done - self.config.warmup_steps
            return local > 0 and local % self.config.sync_every == 0
        return steps_done % self.config.sync_every == 0

    def after_optimizer_step(self, steps_done: int) -> int:
        """Synchronize if the period is over; returns the bytes handed to the collective (0 if none)."""
        if not self.syncs_after(steps_done):
            return 0
        average_parameters(iter(self.parameters), self.group)
        sent = sum(p.numel() * p.element_size() for p in self.parameters)
        if self.outer_optimizer is not None:
            self._outer_step()
        return sent

    @torch.no_grad()
    def _outer_step(self) -> None:
        assert self.outer_optimizer is not None
        for outer, local in zip(self.outer_parameters, self.parameters):
            outer.grad = outer - local  # the pseudo-gradient: how far the replicas' mean moved, reversed
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        for outer, local in zip(self.outer_parameters, self.parameters):
            local.copy_(outer)

    def state_dict(self) -> dict[str, Any]:
        """DiLoCo's outer parameters and outer optimizer state (empty for local SGD, which keeps none)."""
        if self.outer_optimizer is None:
            return {}
        return {"outer_parameters": [p.clone() for p in self.outer_parameters], "outer_optimizer": self.outer_optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.outer_optimizer is None:
            return
        if not state:
            raise RuntimeError("The checkpoint holds no DiLoCo outer state: it was written without sync='diloco'.")
        with torch.no_grad():
            for outer, saved in zip(self.outer_parameters, state["outer_parameters"], strict=True):
                outer.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
