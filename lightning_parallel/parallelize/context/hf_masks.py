"""transformers' mask builders under context parallelism: called with the whole sequence, so masks cover every key.

A transformers model builds its attention masks in its forward from ``attention_mask`` (padding), ``position_ids``
(packed documents: positions that restart) and its config (sliding window, chunked attention), through
``transformers.masking_utils.create_causal_mask`` and its siblings, which its modeling module imported by name.
Called with this rank's part of the sequence they would build a mask over this rank's keys only — and decide from
this rank's part alone whether a mask is needed at all (padding elsewhere unseen). While the model call runs under
context parallelism, those names in the model's modeling modules point to a wrapper that calls the builder with the
whole sequence instead: the whole ``attention_mask`` and ``position_ids`` the splitter cut (or the global positions
the mode made, :mod:`.whole`), and a stand-in of the embeddings with the whole length (only its shape, dtype and
device are read). The builder then runs exactly as on one device — torch ops left alone by the mode — and returns
the whole-sequence mask (or ``None`` where plain causal attention does it). The model gets the mask's block for this
rank (its queries × its own keys: the shape it expects) with the whole mask standing behind it (:mod:`.whole`):
ring attention reads this rank's rows of the whole mask (:mod:`.masks`); what the model does to the mask is
followed on the whole one where it can be (elementwise, views), and otherwise the block is all the ring has (it then
runs only a causal or all-keeping block, and refuses the rest).

Where the builder's inputs cannot all be made whole (a KV cache, extra mask functions of the model's own, a tensor
of this rank's length that is not known whole) it runs as it was called, on this rank's part. No Lightning here.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

#: The model call's mode (:class:`~lightning_parallel.parallelize.context.splitter.ContextParallelMode`; not imported:
#: the splitter imports this module).
ContextParallelMode = Any

_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask",
             "create_bidirectional_mask", "create_bidirectional_sliding_window_mask")
#: Arguments that make the builder depend on more than the sequence's inputs: it then runs on this rank's part.
_OPAQUE = ("encoder_hidden_states",)
#: Mask functions of the model's own, ``(batch, head, q_idx, kv_idx) -> keep``: whole-sequence indices are fine for
#: them unless they read a tensor of this rank's part.
_FUNCTIONS = ("or_mask_function", "and_mask_function")

_EAGER = "eager_attention_forward"  # transformers' attention written out, per modeling module
_active = threading.local()  # the mode of the model call running on this thread (ranks may be threads in tests)
_installed: dict[tuple[str, str], list[Any]] = {}  # (module, name) -> [original, users]
_lock = threading.Lock()


@contextmanager
def active(mode: ContextParallelMode) -> Iterator[None]:
    """Marks ``mode`` as this thread's model call while the wrappers run."""
    stack = _active.__dict__.setdefault("stack", [])
    stack.append(mode)
    try:
        yield
    finally:
        stack.pop()


def _current() -> ContextParallelMode | None:
    stack = getattr(_active, "stack", None)
    return stack[-1] if stack else None


def builder_sites(root: nn.Module) -> list[tuple[str, str]]:
    """``(module name, global name)`` of each transformers mask builder the code of ``root``'s modules calls, and of
    each ``eager_attention_forward`` it defines (:mod:`.hf_attention`)."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        return []
    originals = {id(getattr(masking, name)) for name in _BUILDERS if hasattr(masking, name)}
    sites = set()
    for module in root.modules():
        for cls in type(module).__mro__:
            if not cls.__module__.startswith("transformers.") or cls.__module__ not in sys.modules:
                continue
            for name, value in vars(sys.modules[cls.__module__]).items():
                if id(value) in originals or getattr(value, "_context_parallel_kind", None) == "mask":
                    sites.add((cls.__module__, name))
                elif name == _EAGER and callable(value) and cls.__module__.startswith("transformers.models."):
                    sites.add((cls.__module__, name))
    return sorted(sites)


def install(sites: list[tuple[str, str]]) -> None:
    """Point each site to the whole-sequence wrapper (counted: several splitters may share a module)."""
    with _lock:
        for module_name, name in sites:
            entry = _installed.get((module_name, name))
            if entry is None:
                namespace = vars(sys.modules[module_name])
                original = namespace[name]
                if name == _EAGER:
                    from lightning_parallel.parallelize.context.hf_attention import wrapped_attention

                    namespace[name] = wrapped_attention(original, _current)
                else:
                    namespace[name] = _wrapped(original)
                _installed[(module_name, name)] = [original, 1]
            else:
                entry[1] += 1


def uninstall(sites: list[tuple[str, str]]) -> None:
    with _lock:
        for key in sites:
            entry = _installed.get(key)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                vars(sys.modules[key[0]])[key[1]] = entry[0]
                del _installed[key]


def _wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def build(*args: Any, **kwargs: Any) -> Any:
        mode = _current()
        if mode is None:
            return original(*args, **kwargs)
        whole = whole_arguments(mode, args, kwargs)
        if whole is None:
            return original(*args, **kwargs)
        with mode.suspended():
            mask = original(*whole[0], **whole[1])
            if not isinstance(mask, Tensor) or mask.dim() < 2:
                return mask  # None (plain causal or no mask: decided on the whole sequence), or a flex BlockMask
            # The model gets its block (its queries × its own keys, the shape it expects of its part); the whole
            # mask stands behind it (.whole): ring attention reads this rank's rows of it, and ops the model applies
            # to the mask are followed on it, or drop it (then the block is all the ring knows).
            part = _block(mask, mode.layout)
        mode.whole.add(part, mask)
        return part

    build._context_parallel_original = original  # type: ignore[attr-defined]
    build._context_parallel_kind = "mask"  # type: ignore[attr-defined]
    return build


def whole_arguments(mode: ContextParallelMode, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The builder's arguments with the whole sequence's tensors, or ``None`` where one cannot be made whole."""
    layout = mode.layout
    if any(kwargs.get(name) is not None for name in _OPAQUE):
        return None
    if any(kwargs.get(name) is not None and not _index_based(kwargs[name], layout.local_length) for name in _FUNCTIONS):
        return None
    known = mode.whole

    def whole(value: Any) -> Any:
        if type(value).__name__.endswith("Cache"):
            if not callable(getattr(value, "get_seq_length", None)) or value.get_seq_length() != 0:
                raise _Opaque  # tokens seen before: their keys are not split like the sequence
            return value  # an empty cache (transformers makes one when use_cache is on) sizes the mask as none
        if not isinstance(value, Tensor):
            if callable(value) and not hasattr(value, "to_dict") and not _index_based(value, layout.local_length):
                raise _Opaque  # a mask function reading a tensor of this rank's part
            return value
        found = known.of(value)
        if found is not None:
            return found
        if value.dim() >= 3 and value.is_floating_point() and value.size(1) == layout.local_length:
            # The embeddings: read for their batch size, length, dtype and device only.
            return value[:, :1].expand(value.size(0), layout.length, *value.shape[2:])
        if any(size == layout.local_length for size in value.shape[1:]):
            raise _Opaque  # a tensor of this rank's part whose whole is unknown
        return value

    try:
        with mode.suspended():
            return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}
    except _Opaque:
        return None


class _Opaque(Exception):
    pass


def _block(mask: Tensor, layout: Any) -> Tensor:
    """A whole-sequence mask's block of this rank's queries × its own keys (dims of size 1 broadcast)."""
    positions = layout.positions(mask.device)
    for dim in (-2, -1):
        if mask.size(dim) == layout.length:
            mask = mask.index_select(dim, positions)
    return mask


def _index_based(function: Any, local_length: int, depth: int = 0) -> bool:
    """Whether a mask function reads no tensor with a dim of this rank's length (in its closure, its partial
    arguments, or those of the functions it closes over): then it computes the same on the whole sequence's
    indices (a constant, a window overlay)."""
    if depth > 8:
        return False
    values: list[Any] = []
    values += [cell.cell_contents for cell in getattr(function, "__closure__", None) or () if _filled(cell)]
    values += list(getattr(function, "args", ())) + list((getattr(function, "keywords", None) or {}).values())
    inner = getattr(function, "func", None)
    if inner is not None:
        values.append(inner)
    for value in values:
        if isinstance(value, Tensor):
            if any(size == local_length for size in value.shape):
                return False
        elif callable(value) and not isinstance(value, type):
            if not _index_based(value, local_length, depth + 1):
                return False
    return True


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


__all__ = ["active", "builder_sites", "install", "uninstall", "whole_arguments"]
