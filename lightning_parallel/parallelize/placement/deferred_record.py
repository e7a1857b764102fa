"""How a module's parameters were made while it was built on the meta device, kept to be replayed per rank.

Under :func:`parameters_on_meta` (``trainer.init_module(empty_init=True)``) every torch call is seen by a
:class:`Recorder` (a ``TorchFunctionMode``, as torchdistX's deferred init recorded factory calls): each tensor
made gets a :class:`Node` (the call and the nodes of its tensor arguments), an in-place call
(``fill_``, ``normal_``, ``nn.init.*_``, ``copy_``) gives its target a new node, and a parameter keeps the
node of the tensor it was made from, then the in-place calls on it after registration (``nn.init.normal_(
self.weight)`` in ``__init__``); :data:`RECIPES` keeps both per meta parameter. ``deferred_replay.py`` runs a
node's calls again on the host, or tells that it is one value everywhere (``torch.ones``, ``torch.full``,
``fill_``, times a scalar: a shard is then filled directly). A node that cannot be replayed says why
(:class:`Unreplayable`): a tensor
that no recorded call made (read from a file, passed in, from numpy), a change made through a view, a
creation on another device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

#: Calls that return a view of their first argument (an in-place change to it changes the base).
VIEWS = {"__getitem__", "view", "view_as", "reshape", "narrow", "select", "t", "T", "mT", "transpose", "permute",
         "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "as_strided", "split", "chunk",
         "unbind", "diagonal", "movedim", "swapaxes", "real", "imag", "tensor_split", "unfold"}
#: Calls returning the same values as their first argument, sharing its memory (in-place changes go through).
SAME = {"data", "detach"}
#: Calls that hand out a tensor's memory outside torch calls (numpy, storages): its later changes are not seen.
EXPOSED = {"numpy", "__array__", "untyped_storage", "storage", "_typed_storage", "__dlpack__", "set_", "share_memory_"}
#: Arguments kept in a recipe as they are (anything else, e.g. a numpy array of data, makes it unreplayable).
KEPT = (bool, int, float, complex, str, slice, type(Ellipsis), torch.dtype, torch.device, torch.layout, torch.memory_format)
MAX_KEPT = 64  # values in one list argument (torch.tensor([...]) of a whole parameter's data is not kept)
#: Operators that change their left operand in place.
INPLACE_OPERATORS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__ipow__", "__imod__",
                     "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}


class Unreplayable:
    """A value that cannot be made again, and why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class GeneratorState:
    """An explicit ``torch.Generator`` argument, as it was just before the call (replayed from a copy)."""

    __slots__ = ("device", "state")

    def __init__(self, generator: torch.Generator) -> None:
        self.device, self.state = generator.device, generator.get_state()


class Node:
    """One recorded call that made (or changed in place) a tensor; tensor arguments are nodes."""

    __slots__ = ("func", "name", "args", "kwargs", "index", "shape", "dtype", "default_dtype", "random", "inplace", "__weakref__")

    def __init__(self, func: Any, name: str, args: tuple, kwargs: dict, index: int | None, like: Tensor,
                 random: bool, inplace: bool) -> None:
        self.func, self.name, self.args, self.kwargs, self.index = func, name, args, kwargs, index
        self.shape, self.dtype, self.default_dtype = tuple(like.shape), like.dtype, torch.get_default_dtype()
        self.random, self.inplace = random, inplace

    def inputs(self) -> list[Node | Unreplayable]:
        return [a for a in _leaves((self.args, self.kwargs)) if isinstance(a, (Node, Unreplayable))]


def call_name(func: Any) -> str:
    """``normal_``, ``ones``, ``data`` (a property's getter), ...: the name a call is known by."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class Recorder(TorchFunctionMode):
    """Records every torch call while a module is built; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> its current Node | Unreplayable
        self.bases: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a view -> (its base tensor, a whole alias?)
        self.creations: WeakIdKeyDictionary = WeakIdKeyDictionary()  # registered parameter -> node as registered
        self.random_nodes: list[Node] = []
        self.stream_moved = False  # the generator changed between recorded calls (a manual_seed in __init__)
        self._last_state: Tensor | None = None
        self.paused = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        before = torch.get_rng_state()
        if self._last_state is not None and not torch.equal(before, self._last_state):
            self.stream_moved = True
        generators = {id(g): GeneratorState(g) for g in _leaves((args, kwargs)) if isinstance(g, torch.Generator)}
        result = func(*args, **kwargs)
        self._last_state = torch.get_rng_state()
        try:
            self._record(func, args, kwargs, result, generators, drew=not torch.equal(before, self._last_state))
        except Exception as error:  # recording must never break the user's construction
            for tensor in _leaves(result):
                if isinstance(tensor, Tensor):
                    self.nodes[tensor] = Unreplayable(f"recording {call_name(func)} failed ({error})")
        return result

    def link(self, parameter: Tensor, data: Tensor) -> None:
        """``nn.Parameter(data)``: the parameter is made from ``data``'s node."""
        if data in self.nodes:
            self.nodes[parameter] = self.nodes[data]

    def registered(self, before: Tensor, parameter: Tensor) -> None:
        """``parameter`` (on meta) was registered in place of ``before``: from now on its changes are its own."""
        if parameter in self.creations:
            return  # registered again (a tied weight): it was made where it was first registered
        node = self.nodes.get(before)
        if node is None:
            node = Unreplayable("it is a tensor that no torch call made while the module was built (passed in, read from a file or from numpy)")
        self.nodes[parameter] = self.creations[parameter] = node

    def _convert(self, value: Any, generators: dict[int, GeneratorState]) -> Any:
        if isinstance(value, Tensor):
            node = self.nodes.get(value)
            if node is None:
                return Unreplayable(f"it uses a tensor of shape {tuple(value.shape)} that no torch call made while the module "
                                    f"was built (passed in, read from a file or from numpy)")
            return node
        if isinstance(value, torch.Generator):
            return generators[id(value)]
        if isinstance(value, (list, tuple, dict)) and len(value) > MAX_KEPT:
            return Unreplayable(f"it was made from a {type(value).__name__} of {len(value)} values, which is not kept")
        if isinstance(value, (list, tuple)):
            return type(value)(self._convert(v, generators) for v in value)
        if isinstance(value, dict):
            return {k: self._convert(v, generators) for k, v in value.items()}
        if value is None or isinstance(value, KEPT):
            return value
        # Data (a numpy array, ...) is not kept: the recipes live as long as the meta parameters.
        return Unreplayable(f"it was made from a {type(value).__name__}, which is not kept")

    def _record(self, func: Any, args: tuple, kwargs: dict, result: Any, generators: dict, drew: bool) -> None:
        name = call_name(func)
        first = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
        if getattr(func, "__name__", "") == "__set__" and name == "data" and len(args) == 2:  # tensor.data = other
            self.nodes[args[0]] = self._convert(args[1], generators)
            return
        if name in EXPOSED and isinstance(first, Tensor):  # changes made through these are not seen
            base, _ = self.bases.get(first, (first, True))
            for tensor in {id(first): first, id(base): base}.values():
                self.nodes[tensor] = Unreplayable(f"its memory was reached through {name}, where changes are not recorded")
            return
        inplace = (name.endswith("_") and not name.startswith("__")) or name in INPLACE_OPERATORS
        target = kwargs.get("out") if isinstance(kwargs.get("out"), Tensor) else first if inplace else None
        if inplace and not isinstance(target, Tensor):
            return
        outputs = [target] if target is not None else [t for t in _leaves(result) if isinstance(t, Tensor)]
        if not outputs:
            return  # a size, a bool, ...
        c_args, c_kwargs = self._convert(args, generators), self._convert(kwargs, generators)
        device = outputs[0].device
        for index, output in enumerate(outputs):
            single = target is not None or isinstance(result, Tensor)
            node: Node | Unreplayable
            if device.type not in ("cpu", "meta"):
                node = Unreplayable(f"it was made by {name} on {device}, and only creations on the host are replayed")
            else:
                node = Node(func, name, c_args, c_kwargs, None if single else index, output, drew, target is not None)
                if drew:
                    self.random_nodes.append(node)
            if target is None:
                self.nodes[output] = node
                if name in VIEWS | SAME and isinstance(first, Tensor):
                    base, whole = self.bases.get(first, (first, True))
                    self.bases[output] = (base, whole and name in SAME)
                continue
            self.nodes[target] = node
            base, whole = self.bases.get(target, (target, True))
            if base is not target:  # changed through a view: the base changes too
                self.nodes[base] = node if whole else Unreplayable(f"it was changed in place through a view ({name} on a part of it)")
            if isinstance(result, Tensor) and result is not target:
                self.nodes[result] = node


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


@dataclass(frozen=True)
class Recipe:
    """How a parameter was made while its module was built under :func:`parameters_on_meta`."""

    created: Node | Unreplayable  # the tensor it was registered from
    final: Node | Unreplayable  # with the in-place changes made to it after registration (``nn.init.*_`` in ``__init__``)
    #: As it was when its module was attached to a parent (its own ``__init__`` done): what came later is the
    #: parents' doing, e.g. an ``_init_weights`` applied over the subtree, which is replayed as a step of its own.
    attached: Node | Unreplayable | None = None


#: Meta parameter -> its recipe (forgotten with the parameter).
RECIPES: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: The attribute of a meta parameter that holds its :class:`Construction` (dropped with the meta parameter when
#: the strategy allocates real memory; an attribute, not a weak mapping, since the construction holds the
#: parameter's module: a weak-keyed mapping would keep both alive for good).
CONSTRUCTION = "_lightning_parallel_construction"


class Construction:
    """Every module that registered a parameter under one :func:`parameters_on_meta`, and when each finished building.

    Kept so that modules built and then discarded in ``__init__`` (``del self.w1``, a temporary layer) are
    initialised again in their turn: eager construction drew their random numbers, which moved the stream
    for every module built after them.
    """

    def __init__(self) -> None:
        self.modules: list[nn.Module] = []  # registration order; strong: a discarded module is kept to be replayed
        # Keyed weakly by identity, not by id(): a container attached and then dropped (``del self.block``) frees its
        # address, and a layer built next at that address took the container's earlier end (seen in CI: two layers
        # drew in swapped order). An entry now leaves with its module.
        self._ended: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> event number of its first attachment
        self._registered: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> event of its last registration
        self._events = 0

    def __deepcopy__(self, memo: dict) -> Construction:
        return self  # a record of one build, shared by copies of its meta parameters (not a copy of every module)

    def registered(self, module: nn.Module) -> None:
        if module not in self._registered:
            self.modules.append(module)
        self._registered[module] = self._next()

    def attached(self, module: nn.Module) -> None:
        """``module`` was given a parent: its ``__init__`` is done (a module never attached ends at its last registration)."""
        if module not in self._ended:
            self._ended[module] = self._next()

    def position(self, module: nn.Module) -> int | None:
        """When ``module`` finished building, relative to the others (``None``: not built here or never attached)."""
        ended = self._ended.get(module)
        return ended if ended is not None else self._registered.get(module)

    def _next(self) -> int:
        self._events += 1
        return self._events


def construction_of(module: nn.Module) -> Construction | None:
    """The :class:`Construction` ``module`` was built in, if it was built under :func:`parameters_on_meta`."""
    return next((c for p in module.parameters() if (c := getattr(p, CONSTRUCTION, None)) is not None), None)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Register every parameter created inside on the meta device (no memory); buffers stay as built.

    Each parameter is moved right after it is registered, so a layer's own ``reset_parameters()`` in its
    ``__init__`` runs on the meta tensor: it neither allocates nor draws random numbers. Every torch call
    inside is recorded (:class:`~lightning_parallel.parallelize.placement.deferred_record.Recorder`), and each
    parameter keeps how it was made (:data:`RECIPES`). When the random numbers drawn inside all went into
    parameters (and nothing reseeded the generator), it is given back its state from before, as if nothing
    had been drawn: the draws are replayed in construction's order when the parameters get their values.
    """
    original = nn.Module.register_parameter
    original_new = nn.Parameter.__dict__["__new__"]
    recorder = Recorder()
    construction = Construction()
    before = torch.get_rng_state()

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        recorder.paused = True
        try:
            original(module, name, param)
            if param is not None and not param.is_meta:
                parameter_class = type(param)
                extra = dict(param.__dict__)  # e.g. flags set on a parameter subclass
                module._parameters[name] = parameter_class(param.to("meta"), requires_grad=param.requires_grad, **extra)
            if param is not None:
                recorder.registered(param, module._parameters[name])
                construction.registered(module)
                try:
                    setattr(module._parameters[name], CONSTRUCTION, construction)
                except AttributeError:  # a parameter subclass without a __dict__: its discarded siblings are not replayed
                    pass
        finally:
            recorder.paused = False

    def new_parameter(cls: type, data: Tensor | None = None, *args: Any, **kwargs: Any) -> nn.Parameter:
        parameter = original_new.__func__(cls, data, *args, **kwargs)
        if isinstance(data, Tensor):
            recorder.link(parameter, data)
        return parameter

    attached: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its node when its module got a parent
    original_setattr, original_add = nn.Module.__setattr__, nn.Module.add_module

    def note_attached(child: Any) -> None:
        if isinstance(child, nn.Module):
            construction.attached(child)
            for param in child.parameters():
                if param in recorder.creations and param not in attached:
                    attached[param] = recorder.nodes.get(param, recorder.creations[param])

    def setattr_noting(module: nn.Module, name: str, value: Any) -> None:
        note_attached(value)
        original_setattr(module, name, value)

    def add_module_noting(module: nn.Module, name: str, child: nn.Module | None) -> None:
        note_attached(child)
        original_add(module, name, child)

    nn.Module.register_parameter = register_on_meta
    nn.Parameter.__new__ = staticmethod(new_parameter)  # type: ignore[method-assign,assignment]
    nn.Module.__setattr__ = setattr_noting  # type: ignore[method-assign,assignment]
    nn.Module.add_module = add_module_noting  # type: ignore[method-assign]
    try:
        with recorder:
            yield
    finally:
        nn.Module.register_parameter = original
        nn.Parameter.__new__ = original_new  # type: ignore[method-assign]
        nn.Module.__setattr__ = original_setattr  # type: ignore[method-assign]
        nn.Module.add_module = original_add  # type: ignore[method-assign]
    roots: list[Node | Unreplayable] = []
    for param, created in recorder.creations.items():
        RECIPES[param] = recipe = Recipe(created, recorder.nodes.get(param, created), attached.get(param))
        roots += [recipe.created, recipe.final]
    if recorder.random_nodes and not recorder.stream_moved and _all_in(recorder.random_nodes, roots):
        torch.set_rng_state(before)


def _all_in(nodes: list[Node], roots: list[Node | Unreplayable]) -> bool:
    """Whether every node of ``nodes`` is reachable from ``roots``."""
    reached: set[int] = set()
    stack: list[Any] = list(roots)
    while stack:
        node = stack.pop()
        if isinstance(node, Node) and id(node) not in reached:
            reached.add(id(node))
            stack.extend(node.inputs())
    return all(id(n) in reached for n in nodes)


def recipes_of(module: nn.Module) -> dict[str, Recipe]:
    """The recorded recipes of ``module``'s parameters by every full name (tied aliases included)."""
    return {name: RECIPES[p] for name, p in module.named_parameters(remove_duplicate=False) if p in RECIPES}
