"""Models built without memory: parameters on the meta device, given values only where a rank holds them.

Under ``trainer.init_module(empty_init=True)`` the strategies build the module with its parameters on the
meta device (:func:`parameters_on_meta`); buffers are built as usual, so tables computed in ``__init__``
(rotary frequencies, causal masks) are right. The strategy then splits the meta module (tensor-parallel
plan, pipeline stages, FSDP2), allocates only this rank's part (:func:`allocate_local`), and gives it the
values eager construction would have (:class:`InitialValues`): each module is materialised whole on the
host one at a time, initialised in the order eager construction initialises it, and only this rank's part
is copied out. The extra memory is then the largest single module, not the model.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel.checkpoint.state import copy_whole_into, listing
from lightning_parallel.parallelize.fused import FusedLayout

#: A target tensor by full name: a parameter or buffer this rank holds (whole, a DTensor shard, a stage's).
Targets = Mapping[str, Tensor]


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Register every parameter created inside on the meta device (no memory); buffers stay as built.

    Each parameter is moved right after it is registered, so a layer's own ``reset_parameters()`` in its
    ``__init__`` runs on the meta tensor: it neither allocates nor draws random numbers.
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            parameter_class = type(param)
            extra = dict(param.__dict__)  # e.g. flags set on a parameter subclass
            module._parameters[name] = parameter_class(param.to("meta"), requires_grad=param.requires_grad, **extra)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (built for deferred init)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def check_buffers_built(module: nn.Module) -> None:
    """Refuse a module whose buffers are on the meta device: nothing can recompute them.

    Raises:
        RuntimeError: Listing the buffers and how to build the module instead.
    """
    meta = [name for name, buffer in module.named_buffers() if buffer.is_meta]
    if meta:
        raise RuntimeError(
            f"The buffers {listing(meta)} of {type(module).__name__} are on the meta device, and values computed in "
            f"__init__ cannot be recovered. Build the module under `with trainer.init_module(empty_init=True):` (it keeps "
            f"buffers real and only parameters on the meta device) instead of `torch.device('meta')`."
        )


def allocate_local(module: nn.Module, device: torch.device) -> None:
    """Give every meta tensor of ``module`` uninitialised memory on ``device`` (a DTensor only its shard).

    Other tensors are moved to ``device``. Goes through ``Module._apply``, as ``to_empty`` does, so FSDP2's
    sharded parameters are re-registered; tied parameters (which ``_apply`` gives one new tensor per
    module) are tied again.
    """
    first: dict[int, str] = {}
    aliases: list[tuple[str, str]] = []
    for name, param in module.named_parameters(remove_duplicate=False):
        kept = first.setdefault(id(param), name)
        if kept != name:
            aliases.append((name, kept))
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    for alias, name in aliases:
        owner, _, attribute = alias.rpartition(".")
        (module.get_submodule(owner) if owner else module)._parameters[attribute] = module.get_parameter(name)


def init_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that hold parameters of their own, with their names, in registration order."""
    return [(name, sub) for name, sub in module.named_modules() if any(True for _ in sub.parameters(recurse=False))]


def module_initializer(module: nn.Module) -> tuple[str, Callable[[nn.Module], None]] | None:
    """The per-module initialisation the model applies after building, if it declares one.

    Two conventions: a Hugging Face ``PreTrainedModel`` (its ``_init_weights``), and a module defining
    ``_init_weights(module)`` that it applies to itself with ``self.apply`` (nanoGPT's convention). The
    topmost such module is used, over its own modules, in ``nn.Module.apply``'s order.
    """
    for prefix, sub in module.named_modules():
        init = getattr(sub, "_init_weights", None)
        if callable(init):
            return prefix, init
    return None


class InitialValues:
    """Replays eager initialisation on the host, one module at a time, and copies out this rank's parts.

    Eager construction runs each layer's ``reset_parameters()`` as it is built (registration order), then,
    if the model declares one, a per-module ``_init_weights`` over the model (``nn.Module.apply``'s order,
    children first). Both are replayed with the random stream in step: every module's ``reset_parameters``
    draws from the generator state it had in the first pass, the ``_init_weights`` calls continue one
    stream of their own. The same seed therefore gives the same weights as building on one device, under
    every layout; the generator ends where eager construction leaves it.

    Args:
        skeleton: A meta-device copy of the whole module taken before it was split (no memory).
    """

    def __init__(self, skeleton: nn.Module) -> None:
        self.skeleton = skeleton
        self.units = init_units(skeleton)
        self.initializer = module_initializer(skeleton)
        uncovered = [
            f"{name or '<root>'} ({type(unit).__name__})"
            for name, unit in self.units
            if not callable(getattr(unit, "reset_parameters", None)) and not self._covered(name)
        ]
        if uncovered:
            raise TypeError(
                f"These modules hold parameters but define no reset_parameters(), so they cannot be initialised after "
                f"being built on the meta device: {listing(uncovered)}. Give each a reset_parameters() that sets its own "
                f"parameters (torch's convention for deferred initialisation), or build the model without "
                f"trainer.init_module(empty_init=True)."
            )

    def _covered(self, name: str) -> bool:
        if self.initializer is None:
            return False
        prefix = self.initializer[0]
        return not prefix or name == prefix or name.startswith(prefix + ".")

    @classmethod
    def of(cls, module: nn.Module) -> InitialValues:
        """Record ``module`` (built with meta parameters) before it is split."""
        check_buffers_built(module)
        return cls(meta_skeleton(module))

    @torch.no_grad()
    def write(self, targets: Targets, fused: Mapping[str, FusedLayout] | None = None) -> list[str]:
        """Initialise every tensor in ``targets`` (this rank's, by full name) as eager construction would.

        Args:
            targets: This rank's parameters by full name (aliases of tied weights included).
            fused: Fused projections trained rank-major (their values are reordered before the copy).

        Returns:
            The names written.
        """
        fused = fused or {}
        written: list[str] = []
        first_pass_states: dict[str, Tensor] = {}
        given: set[int] = set()  # tied weights keep the value of their first module (tying follows construction)
        for name, unit in self.units:
            first_pass_states[name] = torch.get_rng_state()
            with _materialised(unit):
                _reset(unit)
                if self.initializer is None:
                    written += _copy_out(name, unit, targets, fused, skip=given)
        if self.initializer is None:
            return written
        prefix, initialize = self.initializer
        root = self.skeleton.get_submodule(prefix)
        by_module = {id(unit): name for name, unit in self.units}
        for sub in _apply_order(root):
            name = by_module.get(id(sub))
            if name is None:
                continue  # no parameters of its own: nothing to give values to
            stream = torch.get_rng_state()
            torch.set_rng_state(first_pass_states[name])
            with _materialised(sub):
                _reset(sub)
                torch.set_rng_state(stream)
                initialize(sub)
                written += _copy_out(name, sub, targets, fused)
        outside = [(n, u) for n, u in self.units if not self._covered(n)]
        for name, unit in outside:  # modules above the initialised model keep their reset values
            stream = torch.get_rng_state()
            torch.set_rng_state(first_pass_states[name])
            with _materialised(unit):
                _reset(unit)
                written += _copy_out(name, unit, targets, fused, skip=given)
            torch.set_rng_state(stream)
        return written


def meta_skeleton(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` with every parameter on the meta device; buffers shared, not copied."""
    memo: dict[int, Any] = {}
    for tensor in module.buffers():
        memo[id(tensor)] = tensor
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    return copy.deepcopy(module, memo)


def _apply_order(module: nn.Module) -> Iterator[nn.Module]:
    """``nn.Module.apply``'s order: each module's children (recursively) before the module itself."""
    for child in module.children():
        yield from _apply_order(child)
    yield module


def _reset(unit: nn.Module) -> None:
    reset = getattr(unit, "reset_parameters", None)
    if callable(reset):
        reset()


@contextmanager
def _materialised(unit: nn.Module) -> Iterator[None]:
    """``unit``'s own parameters whole on the host (NaN until initialised), back on the meta device after."""
    params = unit._parameters
    saved = dict(params)
    unit.__dict__["_lightning_parallel_meta_parameters"] = saved  # which skeleton parameter each host copy is
    for name, param in saved.items():
        if param is not None:
            host = torch.empty_like(param, device="cpu")
            if host.is_floating_point():
                host.fill_(math.nan)
            params[name] = nn.Parameter(host, requires_grad=param.requires_grad)
    try:
        yield
    finally:
        params.update(saved)
        del unit.__dict__["_lightning_parallel_meta_parameters"]


def _copy_out(
    prefix: str, unit: nn.Module, targets: Targets, fused: Mapping[str, FusedLayout], skip: set[int] | None = None
) -> list[str]:
    """Copy ``unit``'s own parameters into the targets this rank holds; refuse values left uninitialised.

    ``skip``: ids of the (skeleton's) parameters already given their value, which are left as they are;
    the ones copied here are added to it. Without it, every copy overwrites.
    """
    written = []
    originals = unit.__dict__.get("_lightning_parallel_meta_parameters", {})
    for local_name, value in unit._parameters.items():
        if value is None:
            continue
        key = id(originals.get(local_name, value))
        if skip is not None:
            if key in skip:
                continue
            skip.add(key)
        name = f"{prefix}.{local_name}" if prefix else local_name
        aliases = [n for n in _names_of(name, targets)]
        if not aliases:
            continue
        if value.is_floating_point() and torch.isnan(value).any():
            raise TypeError(
                f"{name} ({type(unit).__name__}) was not initialised by its reset_parameters() or the model's "
                f"_init_weights: give {type(unit).__name__} a reset_parameters() that sets every parameter it owns."
            )
        for alias in aliases:
            layout = fused.get(alias)
            copy_whole_into(targets[alias], layout.to_rank_major(value) if layout is not None else value)
            written.append(alias)
    return written


def _names_of(name: str, targets: Targets) -> list[str]:
    return [name] if name in targets else []
