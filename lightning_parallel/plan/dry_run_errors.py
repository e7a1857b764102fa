"""What the planner's dry run on the meta device cannot run, said as a clear error naming the module.

A dry run computes no values: an operator whose output *size* depends on values (``unique``, ``nonzero``,
``masked_select``, ``.item()``) has no meta implementation, and the model's forward fails deep inside its own code.
:func:`values_estimated` lets the operators torch can estimate run at their largest size (``nonzero`` as if every
element were non-zero: an upper bound on the work that follows); :func:`named_failures` turns any other such failure
into a ``ValueError`` that names the innermost module running, the operator's complaint, and what the user can do.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

#: Phrases of torch's errors for an operator that needs tensor values (no meta kernel, data-dependent output).
_NEEDS_VALUES = ("meta tensor", "meta kernel", "fake impl", "data-dependent", "cannot be called on meta", "on the meta device",
                 "register_meta")


@contextmanager
def values_estimated() -> Iterator[None]:
    """``nonzero`` on meta returns its largest result (every element non-zero) instead of raising."""
    import torch.fx.experimental._config as fx_config

    saved = fx_config.meta_nonzero_assume_all_nonzero
    fx_config.meta_nonzero_assume_all_nonzero = True
    try:
        yield
    finally:
        fx_config.meta_nonzero_assume_all_nonzero = saved


@contextmanager
def named_failures(module: nn.Module, what: str) -> Iterator[None]:
    """Within the block, an error of an operator that needs tensor values is raised as a ``ValueError`` naming the
    innermost submodule of ``module`` that was running (``what``: the dry run's name, for the message)."""
    names = {id(sub): name or type(module).__name__ for name, sub in module.named_modules()}
    running: list[str] = []

    def enter(sub: nn.Module, _: object) -> None:
        if id(sub) in names:
            running.append(names[id(sub)])

    def leave(sub: nn.Module, _: object, __: object) -> None:
        if id(sub) in names and running:
            running.pop()

    handles = [nn.modules.module.register_module_forward_pre_hook(enter),
               nn.modules.module.register_module_forward_hook(leave)]  # not on error: the stack keeps where it failed
    try:
        yield
    except (NotImplementedError, RuntimeError) as error:
        if not any(phrase in str(error).lower() for phrase in _NEEDS_VALUES):
            raise
        first = str(error).strip().splitlines()[0][:300]
        if running:
            where = f"reached {running[-1]}, whose forward runs"
            fix = f"or make {running[-1]} avoid value-dependent operators"
        else:  # after every forward returned: backward (or the optimizer step)
            where = "ran its forward, but its backward runs"
            fix = "or replace the custom backward or operator that needs values"
        raise ValueError(
            f"The planner cannot profile {type(module).__name__}: {what} on the meta device {where} an operator that "
            f"needs tensor values (a value-dependent output size, or a copy of data), which a dry run does not compute "
            f"({type(error).__name__}: {first}). Train with an explicit layout instead of strategy=auto "
            f"(HybridParallelStrategy with the sizes you choose), {fix}."
        ) from error
    finally:
        for handle in handles:
            handle.remove()
