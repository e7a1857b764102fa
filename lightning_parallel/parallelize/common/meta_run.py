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
