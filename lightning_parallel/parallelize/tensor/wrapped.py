"""Projections wrapped with low-rank adapters (peft's LoRA layers), seen through by the tensor-parallel plan.

``get_peft_model`` replaces each targeted projection ``q_proj`` by a wrapper that holds the original layer as
``q_proj.base_layer`` and, per adapter ``k``, a down projection ``q_proj.lora_A[k]`` (``d_in → r``), an up projection
``q_proj.lora_B[k]`` (``r → d_out``) and a dropout ``q_proj.lora_dropout[k]``; its forward adds
``lora_B(lora_A(dropout(x))) · scaling`` to ``base_layer(x)``. Recognised by structure, not by class: a module that
is no projection itself, holds a projection as ``base_layer``, and whose other parameters are pairs of projections
(one reading the base's input width and writing ``r``, one reading ``r`` and writing the base's output width) keyed
alike in two containers. Anything else with parameters in the wrapper (DoRA's magnitude vectors, embedding adapters)
is not followed: the wrapper stays whole, named in a warning.

While a plan is inferred, checked and applied, each wrapper is swapped for its base layer (:func:`see_through`), so
the model looks exactly as it did before peft wrapped it: the base weights split as the unwrapped model's (head
counts divided, shared region inputs, everything). The adapters then split with their base layer
(:func:`split_adapters`):

- base column-wise (``colwise``, ``colwise_gather_output``): ``lora_B`` splits the same way over its output
  features; ``lora_A`` stays whole (its input is the base's whole input, its ``r`` outputs feed every rank's slice
  of ``lora_B``; its gradient comes out whole on every rank, as the column split sums its input gradient);
- base row-wise: ``lora_A`` splits over its input features (it reads the base's input, this rank's slice), its ``r``
  outputs all-reduced (``r`` values per token: the cheap side); ``lora_B`` stays whole on the whole ``r``.

Each rank then adds its own features of both terms: exact, for any scaling. Dropout on the adapters' input is drawn
alike on every rank where that input is whole (column-wise bases: :class:`SameMaskDropout`), so ``lora_A`` stays one
replicated tensor. No Lightning here.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_parallel.parallelize.tensor.projections import features, is_projection

log = logging.getLogger(__name__)

#: Base styles the adapters follow, and which adapter projection splits (with which style) for each.
_FOLLOWED: dict[str, tuple[str, str]] = {
    "colwise": ("up", "colwise"),
    "colwise_gather_output": ("up", "colwise_gather_output"),
    "rowwise": ("down", "rowwise"),
}


@dataclass(frozen=True)
class WrappedProjection:
    """A projection wrapped with adapters.

    Attributes:
        base: The attribute holding the original projection (``"base_layer"``).
        adapters: Adapter name -> ``(down FQN suffix, up FQN suffix)``, e.g. ``("lora_A.default", "lora_B.default")``.
        dropouts: Adapter name -> FQN suffix of the dropout on the adapters' input, where there is one.
    """

    base: str
    adapters: Mapping[str, tuple[str, str]]
    dropouts: Mapping[str, str]

    def styles(self, fqn: str, style: str) -> dict[str, str]:
        """The modules (full names) that ``style`` on the wrapped projection ``fqn`` splits in the real tree."""
        found = {f"{fqn}.{self.base}": style}
        if style in _FOLLOWED:
            side, adapter_style = _FOLLOWED[style]
            for down, up in self.adapters.values():
                found[f"{fqn}.{up if side == 'up' else down}"] = adapter_style
        return found


def find_wrapped(module: nn.Module, warn: Callable[[str], None] | None = None) -> dict[str, WrappedProjection]:
    """Every adapter wrapper below ``module`` (see the module docstring), by FQN."""
    found: dict[str, WrappedProjection] = {}
    for fqn, sub in module.named_modules():
        base = getattr(sub, "base_layer", None)
        if is_projection(sub) or not isinstance(base, nn.Module) or not is_projection(base):
            continue
        wrapped = _adapters_of(sub, base)
        if isinstance(wrapped, str):
            if warn is not None:
                warn(f"{fqn}: {type(sub).__name__} wraps a projection with {wrapped}; left whole.")
            continue
        found[fqn] = wrapped
    return found


def _adapters_of(wrapper: nn.Module, base: nn.Module) -> WrappedProjection | str:
    """The wrapper's adapter pairs, or why they are not understood."""
    d_in, d_out = features(base)
    downs: dict[str, str] = {}
    ups: dict[str, str] = {}
    dropouts: dict[str, str] = {}
    for child_name, child in wrapper.named_children():
        if child is base:
            continue
        keyed = child.items() if isinstance(child, nn.ModuleDict) else [("", child)]
        for key, sub in keyed:
            name = f"{child_name}.{key}" if key else child_name
            if isinstance(sub, nn.Dropout | nn.Identity):
                dropouts[key] = name
            elif is_projection(sub) and features(sub)[0] == d_in and features(sub)[1] != d_out:
                downs[key] = name
            elif is_projection(sub) and features(sub)[1] == d_out:
                ups[key] = name
            elif any(True for _ in sub.parameters()):
                return f"{name} ({type(sub).__name__}), not a low-rank adapter pair"
    if any(True for _ in wrapper.parameters(recurse=False)):
        return "parameters of its own"
    held = {id(p) for p in base.parameters()} | {
        id(p) for key, down in downs.items() for name in (down, ups.get(key)) if name for p in wrapper.get_submodule(name).parameters()}
    if any(id(p) not in held for p in wrapper.parameters()):
        return "parameters outside its adapter pairs (DoRA magnitudes, embedding adapters)"
    if set(downs) != set(ups) or not downs:
        return "unpaired adapter projections"
    for key, down_name in downs.items():
        down, up = wrapper.get_submodule(down_name), wrapper.get_submodule(ups[key])
        if features(down)[1] != features(up)[0]:
            return f"adapter {key!r} whose down projection writes {features(down)[1]} but whose up projection reads {features(up)[0]}"
    return WrappedProjection(
        base=next(name for name, child in wrapper.named_children() if child is base),
        adapters={key: (downs[key], ups[key]) for key in downs},
        dropouts={key: dropouts[key] for key in downs if key in dropouts},
    )


def wrapped_names(module: nn.Module) -> tuple[dict[str, str], frozenset[str]]:
    """Names of ``module``'s parameters and buffers as the model had them before its projections were wrapped
    (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``), and the names of the adapters' tensors (which the
    unwrapped model has not)."""
    renamed: dict[str, str] = {}
    adapters: set[str] = set()
    for fqn, found in find_wrapped(module).items():
        wrapper = module.get_submodule(fqn)
        for name in wrapper.state_dict(keep_vars=True):
            if name.startswith(f"{found.base}."):
                renamed[f"{fqn}.{name}"] = f"{fqn}.{name[len(found.base) + 1:]}"
            else:
                adapters.add(f"{fqn}.{name}")
    return renamed, frozenset(adapters)


@contextlib.contextmanager
def see_through(module: nn.Module, wrapped: Mapping[str, WrappedProjection]) -> Iterator[None]:
    """Within this, each wrapper in ``wrapped`` is replaced in its parent by its base layer (the tree peft wrapped);
    the wrappers are put back on exit, holding their base layers as they are then (split, hooked)."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for fqn, wrapper in wrapped.items():
            parent_name, _, child = fqn.rpartition(".")
            parent = module.get_submodule(parent_name)
            if parent._modules.get(child) is not module.get_submodule(fqn):  # pragma: no cover - a changed tree
                raise RuntimeError(f"{fqn}: the adapter wrapper moved while the plan was applied.")
            original = parent._modules[child]
            parent._modules[child] = original.get_submodule(wrapper.base)
            swapped.append((parent, child, original))
        yield
    finally:
        for parent, child, original in reversed(swapped):
            parent._modules[child] = original


def wrapped_styles(styles: Mapping[str, str], wrapped: Mapping[str, WrappedProjection]) -> dict[str, str]:
    """``styles`` (names in the seen-through tree) as the real tree's names: a wrapped projection's entry becomes its
    base layer's, plus the adapter projections that split with it."""
    real: dict[str, str] = {}
    for fqn, style in styles.items():
        real.update(wrapped[fqn].styles(fqn, style) if fqn in wrapped else {fqn: style})
    return real


def unfollowed(styles: Mapping[str, str], wrapped: Mapping[str, WrappedProjection]) -> dict[str, str]:
    """Wrapped projections the plan splits in a way their adapters cannot follow, with why."""
    return {fqn: f"style {style!r} on a projection wrapped with adapters (only {', '.join(_FOLLOWED)} are followed by "
                 f"its adapters)" for fqn, style in styles.items() if fqn in wrapped and style not in (*_FOLLOWED, "replicate")}


def split_adapters(module: nn.Module, styles: Mapping[str, str], wrapped: Mapping[str, WrappedProjection], tp_mesh,
                   parallel_style: Callable[[str], object]) -> None:
    """Split each wrapped projection's adapters as its base layer was split (module docstring); make the dropout on
    a whole adapter input draw the same mask on every rank."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan: dict[str, object] = {}
    seed: int | None = None
    for fqn, style in styles.items():
        if fqn not in wrapped or style not in _FOLLOWED:
            continue
        for real, adapter_style in wrapped[fqn].styles(fqn, style).items():
            if real != f"{fqn}.{wrapped[fqn].base}":
                plan[real] = parallel_style(adapter_style)
        if _FOLLOWED[style][0] == "up":
            for dropout_name in wrapped[fqn].dropouts.values():
                dropout = module.get_submodule(f"{fqn}.{dropout_name}")
                if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                    seed = _shared_seed(tp_mesh) if seed is None else seed
                    _replace(module, f"{fqn}.{dropout_name}", SameMaskDropout(dropout.p, seed, fqn))
    if plan:
        parallelize_module(module, tp_mesh, plan)


def _replace(module: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    module.get_submodule(parent_name)._modules[child] = new


def _shared_seed(tp_mesh) -> int:
    """One seed that every rank of ``tp_mesh`` holds (rank 0's), drawn once when the plan is applied."""
    from lightning_parallel.collectives import all_gather_object

    return int(all_gather_object(int(torch.randint(0, 2**62, (1,)).item()), tp_mesh.get_group())[0])


class SameMaskDropout(nn.Module):
    """Dropout whose mask is the same on every tensor-parallel rank, without a collective per call.

    Its random numbers come from a generator of its own seeded from one seed the ranks share and the module's name,
    advanced alike on every rank (each rank calls it as often, with tensors of one shape). The adapters' input is
    whole on every rank beside a column-wise base; masks drawn from each rank's own generator would differ, and the
    replicated ``lora_A`` would get a different gradient on each rank.
    """

    def __init__(self, p: float, seed: int, name: str) -> None:
        super().__init__()
        self.p = p
        self._seed = (seed + sum(ord(c) * 31**i for i, c in enumerate(name))) % 2**63
        self._generators: dict[torch.device, torch.Generator] = {}

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        generator = self._generators.get(x.device)
        if generator is None:
            generator = self._generators[x.device] = torch.Generator(device=x.device).manual_seed(self._seed)
        keep = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1 - self.p, generator=generator)
        return x * keep / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, same mask on every tensor-parallel rank"
