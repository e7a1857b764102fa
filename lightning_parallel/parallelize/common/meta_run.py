"""Running a model on tensors without values (the meta device), as a compiler traces it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def without_values() -> Iterator[None]:
    """Run the model as a compiler traces it, for tensors without values (meta): libraries written to be compiled
    skip their checks on tensor values then (transformers' masks look at the position ids, ``(...).all()``, unless
    ``torch.compiler.is_compiling()``), which a meta tensor cannot answer."""
    original = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_compiling = original


def summed_with_gradient(tensor: torch.Tensor, group: object) -> torch.Tensor:
    """``tensor`` all-reduced (sum) over ``group`` by torch's autograd all-reduce (its gradient summed too).

    That function refuses to run while ``torch.compiler.is_compiling()``; inside :func:`without_values` (a dry run on
    meta, not a compilation) the check is answered as outside it."""
    from lightning_parallel.collectives import differentiable_all_reduce

    patched = torch.compiler.is_compiling
    if patched.__module__ != __name__:  # a real compilation (or none): torch decides
        return differentiable_all_reduce(tensor, group)
    torch.compiler.is_compiling = lambda: False
    try:
        return differentiable_all_reduce(tensor, group)
    finally:
        torch.compiler.is_compiling = patched
