"""Models built without memory: parameters on the meta device, given values only where a rank holds them.

Under ``trainer.init_module(empty_init=True)`` the strategies build the module with its parameters on the
meta device (:func:`parameters_on_meta`); buffers are built as usual, so tables computed in ``__init__``
(rotary frequencies, causal masks) are right, and how each parameter was made is recorded
(``parallelize/placement/deferred_record.py``). The strategy then splits the meta module (tensor-parallel plan,
pipeline stages, FSDP2), allocates only this rank's part (:func:`allocate_local`), and gives it the values
eager construction would have (:class:`InitialValues`): each module is materialised whole on the host one
at a time, initialised in the order eager construction initialises it (its recorded creations replayed,
then its ``reset_parameters()``), and only this rank's part is copied out; a parameter made as one value
everywhere (``torch.ones``, ``torch.full``) is written straight into this rank's shard. The extra memory is
then the largest single module, not the model.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_parallel.checkpoint.state import copy_part_into, copy_whole_into, listing
from lightning_parallel.parallelize.placement.deferred_record import CONSTRUCTION, RECIPES, Node, Recipe, construction_of, recipes_of
from lightning_parallel.parallelize.placement.deferred_record import parameters_on_meta as parameters_on_meta  # the strategies' entry point
from lightning_parallel.parallelize.placement.deferred_replay import ReplayError, constant, reason_not_replayable, replay
from lightning_parallel.parallelize.placement.shard_draws import StepRecorder, draw_into, part_of, part_seed
from lightning_parallel.parallelize.tensor.fused import FusedLayout

#: A target tensor by full name: a parameter or buffer this rank holds (whole, a DTensor shard, a stage's).
Targets = Mapping[str, Tensor]


#: Whether starting values are written at all (see :func:`starting_values_skipped`).
_SKIP_STARTING_VALUES = False


@contextmanager
def starting_values_skipped() -> Iterator[None]:
    """Inside: :meth:`InitialValues.write` leaves this rank's allocated tensors as they are (no draws, no copies).

    For dry runs (``lightning_parallel.dry_run``), whose values are meaningless: replaying construction materialises
    every module whole, which for a 70B-parameter model is hours of random draws on a CPU.
    """
    global _SKIP_STARTING_VALUES
    saved, _SKIP_STARTING_VALUES = _SKIP_STARTING_VALUES, True
    try:
        yield
    finally:
        _SKIP_STARTING_VALUES = saved


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
    aliases = tied_aliases(module)
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    for alias, name in aliases.items():
        owner, _, attribute = alias.rpartition(".")
        (module.get_submodule(owner) if owner else module)._parameters[attribute] = module.get_parameter(name)


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Every further name of a tied parameter -> its first name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        kept = first.setdefault(id(param), name)
        if kept != name:
            aliases[name] = kept
    return aliases


def init_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that hold parameters of their own, with their names, in registration order."""
    return [(name, sub) for name, sub in module.named_modules() if any(True for _ in sub.parameters(recurse=False))]


def initializers(module: nn.Module) -> list[nn.Module]:
    """Modules that initialise their own subtree after building it with ``_init_weights(module)``.

    Two conventions: a Hugging Face ``PreTrainedModel`` (``post_init`` at the end of its ``__init__``;
    nested models initialise their own modules first), and a module that ends its ``__init__`` with
    ``self.apply(self._init_weights)`` (nanoGPT's).
    """
    return [sub for sub in module.modules() if callable(getattr(sub, "_init_weights", None))]


class InitialValues:
    """Replays eager initialisation on the host, one module at a time, and copies out this rank's parts.

    Eager construction is a sequence of initialisations, in the order modules finish building (children
    before their parent, in registration order): each module's own creations (``nn.Parameter(torch.ones(d))``,
    ``torch.randn``, ``nn.init.normal_(self.weight)`` in ``__init__``: replayed from what
    :func:`parameters_on_meta` recorded) and its ``reset_parameters()`` (torch's layers call it at the end of
    ``__init__``; a module that has one replays only how its parameters were made before registration), and,
    where a module initialises its subtree (:func:`initializers`), its ``_init_weights`` over every module of
    it not initialised by a nested one (``nn.Module.apply``'s order). A first pass replays that sequence,
    drawing the same random numbers but keeping nothing, and records the generator state before each step;
    the second materialises each module alone, replays its own steps from those states and copies this
    rank's part out. The same seed therefore gives the same weights as building on one device, under every
    layout, and the generator ends where construction leaves it. Tied weights take the value of the last
    step that initialised them, as in eager. A module whose parameters are all one value everywhere and that
    nothing else initialises is not materialised: each rank fills its shard directly.

    Modules built and then discarded in ``__init__`` (``del self.w1``, a temporary layer) are initialised in their
    turn in the first pass too (their creations and ``reset_parameters()``), as eager construction drew their
    random numbers before those of the modules built after them.

    Args:
        skeleton: A meta-device copy of the whole module taken before it was split (no memory).
        recipes: How each parameter was made, by full name (:func:`recipes_of`).
        discarded: Meta modules built with it and not part of it, with when each finished building.
        positions: When each module of the skeleton finished building, by full name (places the discarded ones).

    Raises:
        TypeError: A module holds parameters that neither its ``reset_parameters``, an ``_init_weights``
            above it, nor a replayable recorded creation initialises.
    """

    def __init__(
        self,
        skeleton: nn.Module,
        recipes: Mapping[str, Recipe] | None = None,
        discarded: list[tuple[int, nn.Module]] | None = None,
        positions: Mapping[str, int] | None = None,
    ) -> None:
        self.skeleton = skeleton
        self.units = init_units(skeleton)
        owners = initializers(skeleton)
        covered = {id(m) for owner in owners for m in owner.modules()}
        self.replayed: dict[int, dict[str, Node]] = {}  # unit -> its own parameters' creations to replay
        self.elsewhere: dict[int, set[str]] = {}  # unit -> tied parameters another unit replays
        self.constants: dict[int, dict[str, Tensor]] = {}  # unit -> one value per parameter: filled in place
        first_holder: dict[int, int] = {}
        uncovered = []
        for name, unit in self.units:
            resets, alone = _reset_method(unit) is not None, id(unit) not in covered
            for local, param in unit._parameters.items():
                if param is None:
                    continue
                full = f"{name}.{local}" if name else local
                recipe = (recipes or {}).get(full)
                if recipe is None:
                    node = None
                elif resets:
                    node = recipe.created
                elif not alone and recipe.attached is not None:
                    # An _init_weights above it is replayed as a step of its own: replaying what it did to the
                    # parameter here too would draw its random numbers twice.
                    node = recipe.attached
                else:
                    node = recipe.final
                reason = "it was not made while the module was built" if node is None else reason_not_replayable(node)
                if first_holder.setdefault(id(param), id(unit)) != id(unit):
                    self.elsewhere.setdefault(id(unit), set()).add(local)
                    continue
                if reason is None:
                    self.replayed.setdefault(id(unit), {})[local] = node  # type: ignore[assignment]
                elif not resets and alone:
                    uncovered.append(f"{full} ({type(unit).__name__}): {reason}")
            own = [p for p in unit._parameters.values() if p is not None and first_holder[id(p)] == id(unit)]
            if not resets and alone and own and len(self.replayed.get(id(unit), {})) == len(own):
                values = {local: constant(node) for local, node in self.replayed[id(unit)].items()}
                if all(v is not None for v in values.values()):
                    self.constants[id(unit)] = values  # type: ignore[assignment]
        if uncovered:
            raise TypeError(
                f"These modules hold parameters but define no reset_parameters(), and how these parameters were made "
                f"cannot be replayed, so they cannot be initialised after being built on the meta device: "
                f"{listing(uncovered)}. Give each module a reset_parameters() that sets its own parameters (torch's "
                f"convention for deferred initialisation), or build the model without trainer.init_module(empty_init=True)."
            )
        steps = _construction_steps(skeleton, {id(u) for _, u in self.units}, {id(o) for o in owners})
        self.steps = _in_construction_order(steps, self._replayable_discarded(discarded or []), skeleton, positions or {})

    def _replayable_discarded(self, discarded: list[tuple[int, nn.Module]]) -> list[tuple[int, nn.Module]]:
        """The discarded modules holding parameters, each with what of its own creations can be replayed (the rest
        drew nothing that can be known: left out, as eager construction's values for them are thrown away anyway)."""
        kept = []
        for position, unit in discarded:
            resets = _reset_method(unit) is not None
            nodes = {}
            for local, param in unit._parameters.items():
                recipe = RECIPES.get(param) if param is not None else None
                node = None if recipe is None else recipe.created if resets else recipe.final
                if node is not None and reason_not_replayable(node) is None:
                    nodes[local] = node
            if nodes or resets:
                self.replayed[id(unit)] = nodes
                kept.append((position, unit))
        return kept

    @classmethod
    def of(cls, module: nn.Module) -> InitialValues:
        """Record ``module`` (built with meta parameters) before it is split."""
        check_buffers_built(module)
        construction = construction_of(module)
        discarded: list[tuple[int, nn.Module]] = []
        positions: dict[str, int] = {}
        if construction is not None:
            named = dict(module.named_modules(remove_duplicate=False))
            present = {id(m) for m in named.values()}
            for name, sub in named.items():
                if name and (position := construction.position(sub)) is not None:
                    positions.setdefault(name, position)
            for sub in construction.modules:
                position = construction.position(sub)
                if id(sub) not in present and position is not None and any(True for _ in sub.parameters(recurse=False)):
                    discarded.append((position, sub))
        return cls(meta_skeleton(module), recipes_of(module), discarded, positions)

    def _construct(self, unit: nn.Module) -> None:
        """``unit``'s own step of eager construction, on its materialised parameters: creations, then reset."""
        memo: dict[int, Tensor] = {}  # one replay per unit: tensors shared between its parameters stay shared
        for local, node in self.replayed.get(id(unit), {}).items():
            try:
                unit._parameters[local].copy_(replay(node, memo))  # type: ignore[union-attr]
            except ReplayError as error:
                prefix = next((f"{n}." for n, u in self.units if u is unit and n), "")
                raise TypeError(
                    f"{prefix}{local} ({type(unit).__name__}) could not be made again as it was made in __init__: {error}. Give "
                    f"{type(unit).__name__} a reset_parameters() that sets it, or build the model without "
                    f"trainer.init_module(empty_init=True)."
                ) from error
        _reset(unit)

    @torch.no_grad()
    def write(self, targets: Targets, fused: Mapping[str, FusedLayout] | None = None) -> list[str]:
        """Initialise every tensor in ``targets`` (this rank's, by full name) as eager construction would.

        Args:
            targets: This rank's parameters by full name (aliases of tied weights included); empty to only
                advance the generator as construction does.
            fused: Fused projections trained rank-major (their values are reordered before the copy).

        Returns:
            The names written.
        """
        if _SKIP_STARTING_VALUES:
            return []
        fused = fused or {}
        scratch = HostScratch()
        reset_state: dict[int, Tensor] = {}
        init_state: dict[int, tuple[Tensor, Callable[[nn.Module], None]]] = {}
        last_step: dict[int, int] = {}
        for index, (kind, unit, owner) in enumerate(self.steps):  # first pass: draws only
            state = torch.get_rng_state()
            if kind == "reset":
                reset_state[id(unit)] = state
                if id(unit) not in self.constants:  # constants draw nothing
                    with _materialised(unit, scratch):
                        self._construct(unit)
            else:
                init_state[id(unit)] = (state, owner._init_weights)  # type: ignore[union-attr]
                with _materialised(unit, scratch):
                    owner._init_weights(unit)  # type: ignore[union-attr]
            last_step[id(unit)] = index
        if not targets:
            return []
        end = torch.get_rng_state()
        written: list[str] = []
        names = {id(u): n for n, u in self.units}
        # The order in which a tied weight's final value is decided: modules only reset keep the first
        # module's value (tying follows construction), initialised ones the last initialisation's.
        reset_only = [u for _, u in reversed(self.units) if id(u) not in init_state]
        initialised = sorted((u for _, u in self.units if id(u) in init_state), key=lambda u: last_step[id(u)])
        for unit in [*reset_only, *initialised]:
            if id(unit) in self.constants:
                written += _fill_constants(names[id(unit)], self.constants[id(unit)], targets)
                continue
            with _materialised(unit, scratch):
                torch.set_rng_state(reset_state[id(unit)])
                self._construct(unit)
                if id(unit) in init_state:
                    state, initialize = init_state[id(unit)]
                    torch.set_rng_state(state)
                    initialize(unit)
                written += _copy_out(names[id(unit)], unit, targets, fused, self.elsewhere.get(id(unit), set()))
        torch.set_rng_state(end)
        return written


    @torch.no_grad()
    def draw_into_shards(self, targets: Targets, seed: int, fused: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Initialise every parameter in ``targets`` with the distribution eager construction gives it, drawn
        straight into this rank's part on its device (:mod:`~lightning_parallel.parallelize.placement.shard_draws`):
        nothing is materialised whole, and the values are not eager construction's bits.

        Args:
            targets: This rank's parameters by full name (aliases of tied weights included).
            seed: The same on every rank (rank 0's draw).
            fused: Names of fused projections trained rank-major (a step on a part of one is refused: its rows
                are reordered).

        Returns:
            The names written.

        Raises:
            TypeError: A parameter's initialisation cannot be replayed on a part (named, with the operator).
        """
        if _SKIP_STARTING_VALUES:
            return []
        names = {id(u): n for n, u in self.units}
        units = {id(u): u for _, u in self.units}
        recorder = StepRecorder(dict(self.skeleton.named_parameters()))
        written: list[str] = []
        with recorder.recording():
            for unit_id, nodes in self.replayed.items():
                if unit_id in self.constants or unit_id not in units:
                    continue  # constants are filled as they are; discarded modules hold nothing of the model
                if _reset_method(units[unit_id]) is None:
                    for local in nodes:  # made by an expression in __init__: only an initialisation after it counts
                        full = f"{names[unit_id]}.{local}" if names[unit_id] else local
                        recorder.refuse(full, "made by an expression in __init__ with no reset_parameters()")
            for kind, unit, owner in self.steps:
                try:
                    if kind == "reset":
                        if id(unit) not in self.constants:
                            _reset(unit)
                    else:
                        owner._init_weights(unit)  # type: ignore[union-attr]
                except Exception as error:  # noqa: BLE001 - any failure on the meta skeleton: say which module, how to fix
                    raise TypeError(
                        f"{type(unit).__name__}'s initialisation could not run on the meta device to be replayed on "
                        f"this rank's shards ({type(error).__name__}: {error}). Use init_values='eager'."
                    ) from error
        for unit_id, values in self.constants.items():
            written += _fill_constants(names[unit_id], values, targets)
        aliases = tied_aliases(self.skeleton)
        done: set[int] = set()
        for name, target in targets.items():
            first = aliases.get(name, name)
            if first not in recorder.recorded or id(target) in done or first in written:
                continue
            recorded = recorder.recorded[first]
            if first in fused and any(step.view is not None for step in recorded.steps):
                recorded = type(recorded)([], "a part of a fused projection trained rank-major")
            if recorded.refused is not None or not recorded.steps:
                why = recorded.refused or "nothing initialised it"
                raise TypeError(
                    f"{first} cannot be drawn into this rank's shard: {why}. Use init_values='eager' (the values eager "
                    f"construction gives, built one module at a time on the host), or give its module a "
                    f"reset_parameters() made of elementwise draws."
                )
            local, offset = part_of(target, recorder.shapes[first])
            draw_into(local, offset, recorder.shapes[first], recorded.steps, part_seed(seed, first, offset, tuple(local.shape)))
            done.add(id(target))
            written.append(name)
        return written


def _fill_constants(prefix: str, values: Mapping[str, Tensor], targets: Targets) -> list[str]:
    """Write parameters that are one value everywhere straight into this rank's part (no whole tensor)."""
    written = []
    for local_name, value in values.items():
        name = f"{prefix}.{local_name}" if prefix else local_name
        if name in targets:
            target = targets[name]
            (target.to_local() if isinstance(target, DTensor) else target).fill_(value)
            written.append(name)
    return written


def _construction_steps(
    module: nn.Module, units: set[int], owners: set[int]
) -> list[tuple[str, nn.Module, nn.Module | None]]:
    """Eager construction's initialisation steps: ``("reset", unit, None)`` and ``("init", module, owner)``."""
    steps: list[tuple[str, nn.Module, nn.Module | None]] = []
    initialised: set[int] = set()

    def build(sub: nn.Module) -> None:
        for child in sub.children():
            build(child)
        if id(sub) in units:
            steps.append(("reset", sub, None))
        if id(sub) in owners:
            for inner in _apply_order(sub):
                if id(inner) not in initialised:
                    initialised.add(id(inner))
                    steps.append(("init", inner, sub))

    build(module)
    return steps


def _in_construction_order(
    steps: list[tuple[str, nn.Module, nn.Module | None]],
    discarded: list[tuple[int, nn.Module]],
    skeleton: nn.Module,
    positions: Mapping[str, int],
) -> list[tuple[str, nn.Module, nn.Module | None]]:
    """``steps`` (the module tree's order) with a ``("reset", module, None)`` step per discarded module, all ordered by
    when each module finished building (an ``_init_weights`` step: when its owner did; the root last).

    The tree's order is construction's unless ``__init__`` replaced a child (``self.layers = ...`` again keeps
    the first one's place among the children although it was built later) or threw modules away; a step whose
    module's end is unknown keeps its place after the step before it.
    """
    if not positions and not discarded:
        return steps
    at = {id(sub): positions.get(name) for name, sub in skeleton.named_modules(remove_duplicate=False) if name}
    keyed: list[tuple[float, int, tuple[str, nn.Module, nn.Module | None]]] = []
    last = float("-inf")
    for index, (kind, unit, owner) in enumerate(steps):
        module = unit if kind == "reset" else owner
        known = float("inf") if module is skeleton else at.get(id(module))
        last = last if known is None else known
        keyed.append((last, index, (kind, unit, owner)))
    keyed += [(made, -1, ("reset", unit, None)) for made, unit in discarded]
    return [step for _, _, step in sorted(keyed, key=lambda k: (k[0], k[1]))]


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


def _reset_method(unit: nn.Module) -> Callable[[], None] | None:
    """``reset_parameters`` (torch's convention; ``nn.MultiheadAttention`` names it ``_reset_parameters``)."""
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(unit, name, None)
        if callable(method):
            return method
    return None


def _reset(unit: nn.Module) -> None:
    reset = _reset_method(unit)
    if reset is not None:
        reset()


class HostScratch:
    """One host buffer that every module is materialised in, in turn.

    Allocating and freeing each module's tensors would leave the allocator's heap fragmented: resident
    memory then grows towards the whole model although only one module is alive at a time.
    """

    ALIGN = 64

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def tensors(self, like: list[Tensor]) -> list[Tensor]:
        """Uninitialised host tensors shaped and typed like ``like``, views of the buffer (valid until the next call)."""
        sizes = [-(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN for t in like]
        if sum(sizes) > self._buffer.numel():
            self._buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        views, offset = [], 0
        for t, size in zip(like, sizes):
            raw = self._buffer[offset : offset + t.numel() * t.element_size()]
            views.append(raw.view(t.dtype).view(t.shape))
            offset += size
        return views


@contextmanager
def _materialised(unit: nn.Module, scratch: HostScratch) -> Iterator[None]:
    """``unit``'s own parameters whole on the host (NaN until initialised), back on the meta device after."""
    params = unit._parameters
    saved = dict(params)
    present = [(name, p) for name, p in saved.items() if p is not None]
    for (name, param), host in zip(present, scratch.tensors([p for _, p in present])):
        if host.is_floating_point():
            host.fill_(math.nan)
        params[name] = nn.Parameter(host, requires_grad=param.requires_grad)
    try:
        yield
    finally:
        params.update(saved)


def _copy_out(prefix: str, unit: nn.Module, targets: Targets, fused: Mapping[str, FusedLayout], elsewhere: set[str]) -> list[str]:
    """Copy ``unit``'s own parameters into the targets this rank holds; refuse values left uninitialised
    (except tied ones in ``elsewhere``, whose first holder gives them their value)."""
    written = []
    for local_name, value in unit._parameters.items():
        if value is None:
            continue
        name = f"{prefix}.{local_name}" if prefix else local_name
        if name not in targets:
            continue  # held by another rank (another pipeline stage)
        unset = value.is_floating_point() and bool(value.sum().isnan())  # a sum, not a mask: no temporary of the tensor's size
        if unset and local_name in elsewhere:
            continue
        if unset:
            raise TypeError(
                f"{name} ({type(unit).__name__}) was not initialised by its reset_parameters() or the model's "
                f"_init_weights: give {type(unit).__name__} a reset_parameters() that sets every parameter it owns."
            )
        layout = fused.get(name)
        if layout is not None:
            copy_whole_into(targets[name], layout.to_rank_major(value))
        else:
            copy_part_into(targets[name], lambda index, value=value: value if index is None else value[index])
        written.append(name)
    return written
