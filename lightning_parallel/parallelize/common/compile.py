"""``torch.compile`` per block: each layer of the trunk compiled in place, names and state dict unchanged.

The blocks are the ones activation checkpointing and FSDP2 use (each layer of the model's trunk, the
longest ``nn.ModuleList`` / ``nn.Sequential``). Each is compiled with ``nn.Module.compile`` — on the
instance, so module and parameter names, state dicts and checkpoints have no ``_orig_mod.`` — after
tensor parallelism and activation checkpointing and before data-parallel wrapping, as torchtitan orders
it. Identical blocks reuse one compiled graph (their parameters are graph inputs), so compile time does
not grow with depth. Inside pipeline stages the same blocks of the traced stage modules are compiled.
Compilation is lazy: it happens at a block's first call, where an error is re-raised naming the block
and the option that leaves it out. An activation-checkpointed block compiles to one graph too, Python side
effects in its forward included (:func:`_checkpoint_side_effects_once`). No Lightning here.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import wraps
from typing import Any

from torch import nn

from lightning_parallel.parallelize.common.trunk import find_trunk, trunk_layer_names

#: ``torch.compile`` keywords ``compile_options`` may set.
COMPILE_KEYWORDS = ("backend", "mode", "fullgraph", "dynamic", "options")


@dataclass(frozen=True)
class CompileConfig:
    """``torch.compile`` of each block of the trunk.

    Attributes:
        enabled: Compile (flat option ``compile``).
        options: Keywords for ``torch.compile`` (flat option ``compile_options``): ``backend``, ``mode``,
            ``fullgraph``, ``dynamic``, ``options``.
        exclude: Glob patterns of block names (relative to the LightningModule, e.g. ``model.blocks.3``)
            left eager (flat option ``compile_exclude``).
    """

    enabled: bool = field(default=False, metadata={"option": "compile"})
    options: Mapping[str, Any] | None = field(default=None, metadata={"option": "compile_options"})
    exclude: Sequence[str] = field(default=(), metadata={"option": "compile_exclude"})

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise TypeError(f"compile must be true or false, got {self.enabled!r}.")
        options = dict(self.options or {})
        unknown = sorted(set(options) - set(COMPILE_KEYWORDS))
        if unknown:
            close = difflib.get_close_matches(unknown[0], COMPILE_KEYWORDS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"compile_options has {unknown}, which torch.compile does not take; it takes {list(COMPILE_KEYWORDS)}.{hint}")
        exclude = (self.exclude,) if isinstance(self.exclude, str) else tuple(self.exclude or ())
        if not all(isinstance(p, str) for p in exclude):
            raise TypeError(f"compile_exclude must be a list of module-name patterns, got {self.exclude!r}.")
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "exclude", exclude)

    def excluded(self, name: str) -> bool:
        return any(fnmatchcase(name, pattern) for pattern in self.exclude)


def trunk_blocks(module: nn.Module) -> list[str]:
    """The names of the trunk's layers (what ``compile: true`` compiles), relative to ``module``.

    Raises:
        ValueError: ``module`` has no list of layers.
    """
    try:
        trunk_name, trunk = find_trunk(module)
    except ValueError:
        raise ValueError(
            f"compile=true compiles each layer of the model's trunk (its longest nn.ModuleList or nn.Sequential), and "
            f"{type(module).__name__} has none: keep the repeated layers in one (self.blocks = nn.ModuleList(...)), or set "
            "compile=false."
        ) from None
    return trunk_layer_names(trunk_name, trunk)


def compile_blocks(module: nn.Module, names: Sequence[str], config: CompileConfig, prefix: str = "") -> list[str]:
    """Compile the blocks ``names`` of ``module`` in place (those ``config.exclude`` leaves out stay eager).

    Args:
        module: Holds the blocks (the LightningModule, or a pipeline stage's module).
        names: The blocks, relative to ``module``.
        config: Options and exclusions.
        prefix: What to put before a name in exclusion patterns and messages (a pipeline's root).

    Returns:
        The full names of the blocks compiled.
    """
    compiled = []
    _checkpoint_side_effects_once()
    for name in names:
        full = prefix + name
        if config.excluded(full):
            continue
        block = module.get_submodule(name)
        if getattr(block, "_compiled_call_impl", None) is not None:
            compiled.append(full)  # compiled already (fit, then validate)
            continue
        block.compile(**_options_for(block, config.options or {}))
        block._compiled_call_impl = _naming_errors(full, block._compiled_call_impl)
        compiled.append(full)
    return compiled


def _options_for(block: nn.Module, options: Mapping[str, Any]) -> dict[str, Any]:
    """``torch.compile`` keywords for ``block``: inductor's FX graph cache is off for blocks with DTensor
    parameters, whose graphs call collectives by process-group name; a cached graph from another run (or
    another layout) names a group this process numbered differently ("Could not resolve the process group")."""
    options = dict(options)
    from torch.distributed.tensor import DTensor

    inductor = options.get("backend", "inductor") == "inductor"
    if inductor and any(isinstance(p, DTensor) for p in block.parameters()):
        options["options"] = {"fx_graph_cache": False, **dict(options.get("options") or {})}
    return options


def _naming_errors(name: str, compiled: Callable[..., Any]) -> Callable[..., Any]:
    """Re-raise a compilation failure of block ``name`` with its name and how to leave it eager."""
    failures = _compilation_errors()

    @wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except failures as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise RuntimeError(
                f"torch.compile failed on block {name!r}: {type(error).__name__}: {first}. Leave it eager with "
                f"compile_exclude=[{name!r}] (or a pattern), or set compile=false."
            ) from error

    return call


def _checkpoint_side_effects_once() -> None:
    """Let dynamo compile a block whose activation-checkpointed forward has Python side effects (transformers'
    hub-kernel layers set and reset a context variable around each attention call; a module may count its calls):
    they happen once, in the forward. Otherwise dynamo gives up on the whole block (no graph, a graph break),
    because eager checkpointing would replay them in the recomputation, which a compiled backward never does (it
    replays the graph's tensor operations, traced with the forward's Python state, so numbers are unchanged).
    Set for the process, not around each block call: a scoped patch would cost more than the compiled call itself
    (~25 µs against ~16 µs on the CPU); it only changes code that would otherwise fall back to eager."""
    # Private torch API (checked against torch 2.13): the dynamo flag that accepts this; absent in older torch.
    import torch._dynamo.config as dynamo_config

    if hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def _compilation_errors() -> tuple[type[BaseException], ...]:
    from torch._dynamo.exc import TorchDynamoException

    errors: list[type[BaseException]] = [TorchDynamoException]
    try:
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    except ImportError:  # older torch
        pass
    return tuple(errors)
