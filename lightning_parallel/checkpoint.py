"""Checkpoint state for sharded modules: full (unsharded) tensors in, full tensors out.

Built on ``torch.distributed.checkpoint.state_dict``: every rank takes part, the result holds ordinary
tensors keyed by the module's own parameter names, so a file written under tensor parallelism loads into
the plain module with ``load_state_dict``. Resharding sharded (DCP) checkpoints across layouts builds on this.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """Unsharded model state (a collective: call on every rank)."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state(module: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Load an unsharded state into a (possibly sharded) module on every rank."""
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def full_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Unsharded optimizer state keyed by parameter names (a collective: call on every rank)."""
    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load :func:`full_optimizer_state` output into ``optimizer`` over a (possibly sharded) module."""
    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))
