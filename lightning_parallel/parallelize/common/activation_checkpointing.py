"""Activation checkpointing by name: chosen submodules keep only their inputs and recompute in backward.

``activation_checkpointing`` is ``"auto"`` (each layer of the trunk: the longest ``nn.ModuleList`` or
``nn.Sequential``, i.e. the transformer blocks), or glob patterns of module names. A matched module's
``forward`` is replaced, on the instance, by torch's non-reentrant ``torch.utils.checkpoint``: module and
parameter names stay as they were (checkpoints, plans and optimizers see no wrapper), and the same works
on a traced pipeline stage's modules. Numbers are unchanged; memory of activations inside each block is
traded for one more forward of it in backward. No Lightning here.
"""

from __future__ import annotations

import difflib
from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from fnmatch import fnmatchcase
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from lightning_parallel.parallelize.common.trunk import find_trunk, trunk_layer_names

#: Marks a module whose forward is already checkpointed (applying twice would recompute twice).
_MARK = "_lightning_parallel_checkpointed"


def normalize_patterns(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``activation_checkpointing`` as a tuple: ``()`` (off), ``("auto",)`` or patterns.

    Raises:
        TypeError: Not ``None``, a string or a list of strings.
        ValueError: ``"auto"`` mixed with patterns.
    """
    if value is None or value is False or value == "none":
        return ()
    patterns = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"activation_checkpointing must be 'auto' or a list of module-name patterns, got {value!r}.")
    if "auto" in patterns and len(patterns) > 1:
        raise ValueError(f"activation_checkpointing={list(patterns)}: use 'auto' alone, or only module-name patterns.")
    return patterns


def checkpoint_targets(module: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Names of the submodules of ``module`` that ``patterns`` select (outermost only).

    Raises:
        ValueError: A pattern matches nothing (with near matches), or ``auto`` finds no trunk.
    """
    if not patterns:
        return []
    names = [name for name, _ in module.named_modules() if name]
    if tuple(patterns) == ("auto",):
        try:
            trunk_name, trunk = find_trunk(module)
        except ValueError as error:
            raise ValueError(f"activation_checkpointing='auto' needs a list of layers: {error}") from None
        return trunk_layer_names(trunk_name, trunk)
    selected: list[str] = []
    for pattern in patterns:
        matched = [name for name in names if fnmatchcase(name, pattern)]
        if not matched:
            near = difflib.get_close_matches(pattern, names, n=5, cutoff=0.5)
            hint = f" Near matches: {', '.join(near)}." if near else ""
            raise ValueError(f"activation_checkpointing pattern {pattern!r} matches no submodule of {type(module).__name__}.{hint}")
        selected += [name for name in matched if name not in selected]
    # A module inside a checkpointed one is recomputed with it anyway.
    return [n for n in selected if not any(n.startswith(f"{outer}.") for outer in selected if outer != n)]


def apply_activation_checkpointing(module: nn.Module, names: Sequence[str]) -> list[str]:
    """Checkpoint the submodules ``names`` of ``module`` that exist in it; returns those done.

    Names absent from ``module`` are skipped: a pipeline stage holds only some of the layers.
    """
    done = []
    for name in names:
        try:
            target = module.get_submodule(name)
        except AttributeError:
            continue
        if not getattr(target, _MARK, False):
            # A block split by tensor parallelism stays out of compiled graphs (see _eager_checkpoint): decided here,
            # once, as nothing inside a compiled frame may look at its parameters (dynamo would keep weak references
            # to them, and later dtype or device moves could not swap them).
            wrapper = _eager_checkpoint if _holds_dtensors(target) else _checkpointed
            target.forward = partial(wrapper, target.forward)
            setattr(target, _MARK, True)
        done.append(name)
    return done


#: How many of this module's checkpointed forwards (or their recomputations) are running. Raised by the
#: checkpoint's own contexts (:func:`_same_function_modes`), around the block rather than inside it: the
#: checkpointed function stays free of Python side effects.
_running = [0]


def inside_mode_carrying_checkpoint() -> bool:
    """Whether a block checkpointed here is running (its recomputation re-enters the forward's function modes)."""
    return _running[0] > 0


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if torch.compiler.is_dynamo_compiling():
        # A compiled block (compile.py compiles the blocks after checkpointing them): dynamo turns the checkpoint
        # into its own higher-order op, plans the recomputation from the graph, and gives up on the whole block
        # (no graph, a graph break) if the checkpointed function mutates Python state, and at AOT time refuses a
        # context_fn that is not a TorchDispatchMode. So torch's default contexts here: they tag every op for
        # recomputation. Nothing is lost: the function modes active while tracing are inlined into the graph, which
        # the recomputation replays, and context parallelism (the one mode that needs carrying) refuses compile.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    # Non-reentrant: works with inputs that need no grad, keyword arguments, DDP and FSDP2.
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_same_function_modes, **kwargs)


@torch.compiler.disable
def _eager_checkpoint(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # A checkpointed block split by tensor parallelism runs eagerly (a graph break): compiled whole, torch 2.13's AOT
    # autograd keeps the DeviceMesh of the block's DTensors among the tensors saved for backward and stops
    # ("expected all tensors_saved_with_vc_check to be Tensors").
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_same_function_modes, **kwargs)


def _holds_dtensors(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def _same_function_modes() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """Checkpoint contexts: the recomputation in backward runs under the torch function modes the forward ran
    under (the autograd engine does not carry them into backward). Context parallelism's mode is one: without
    it a recomputed block would attend only within this rank's part of the sequence. Both contexts count the
    block as running (:func:`inside_mode_carrying_checkpoint`)."""
    # Private torch API (checked against torch 2.13): the active modes, innermost last.
    from torch.overrides import _get_current_function_mode_stack

    modes = list(_get_current_function_mode_stack())
    return _running_under([]), _running_under(modes)


@contextmanager
def _running_under(modes: list[Any]) -> Generator[None, None, None]:
    with ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        _running[0] += 1
        try:
            yield
        finally:
            _running[0] -= 1
