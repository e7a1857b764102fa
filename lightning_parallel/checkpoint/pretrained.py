"""Pretrained weights read straight into this rank's tensors (``weights_from``), never the whole model.

Three sources: a full checkpoint file (memory-mapped: only the slices a rank copies are read), a sharded
checkpoint directory of this library (DCP's planner reads what each rank's shards cover) and a Hugging
Face model directory (``safetensors``' ``get_slice``; one file or sharded with an index; Mixture-of-Experts
layers stored one module per expert are read as the fused experts the model holds, each rank reading only
its own experts: :mod:`~lightning_parallel.checkpoint.expert_conversion`). Names are
matched first — the source's names may lack a prefix of the module's (a Hugging Face model held as
``self.model`` in a LightningModule) — and checked: missing, unexpected and mis-shaped tensors are listed
before anything is read. Values are converted to the dtype of the tensor they go into.

A checkpoint file (and a sharded checkpoint's non-tensor items) is read without running code from it: an object
that only a full unpickle builds is refused, naming ``trust_pickle`` (``checkpoint/unpickling.py``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_parallel.checkpoint.expert_conversion import PerExpertSource, stored_per_expert
from lightning_parallel.checkpoint.sharded import (
    MODEL_KEY,
    load_states,
    stored_shapes,
    stored_tensors,
)
from lightning_parallel.checkpoint.state import (
    copy_part_into,
    copy_whole_into,
    describe_mismatch,
)
from lightning_parallel.checkpoint.unpickling import UntrustedPickleError, load_file

#: How a refusal to unpickle names the opt-in (the strategy's option beside weights_from).
OPT_IN = "trust_pickle=True to the strategy (beside weights_from; in a recipe: strategy.trust_pickle=true)"

SAFETENSORS_INDEX = "model.safetensors.index.json"


class SlicedSource(Protocol):
    """Stored tensors that can be read in part."""

    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    def read(self, name: str, index: tuple[slice, ...] | None) -> Tensor: ...


def load_pretrained(
    path: str | os.PathLike,
    targets: Mapping[str, Tensor],
    fused: Mapping[str, Any] | None,
    *,
    whole_shapes: Mapping[str, tuple[int, ...]],
    aliases: Mapping[str, str] | None = None,
    trust_pickle: bool = False,
    unwrapped_names: Mapping[str, str] | None = None,
    adapters: Collection[str] = (),
) -> list[str]:
    """Copy the weights stored at ``path`` into ``targets`` (this rank's tensors by full name).

    Args:
        path: A full checkpoint file, a sharded checkpoint directory, or a Hugging Face model directory.
        targets: This rank's parameters and buffers (whole, DTensor shards, or its pipeline stages').
        fused: Fused projections trained rank-major, by name (values are reordered before the copy).
        whole_shapes: Name -> shape of every tensor of the whole module: what the source must hold.
        aliases: Tied names -> the name they share a tensor with (a source may store only one of them).
        trust_pickle: Unpickle a checkpoint file in full, running any code it names (only for files you trust).
        unwrapped_names: Names of tensors of projections wrapped with adapters (peft's LoRA layers) -> their names in
            the model before wrapping (``q_proj.base_layer.weight`` -> ``q_proj.weight``). A source that stores none
            of the wrapped names holds the base model: it is read by the unwrapped names, and ``adapters`` (the
            adapters' tensor names) keep the values they have (peft's initialisation).

    Returns:
        The target names written.

    Raises:
        FileNotFoundError: Nothing at ``path``.
        ValueError: ``path`` is none of the three sources.
        RuntimeError: The stored tensors do not fit the module (all differences listed); nothing is read then.
        UntrustedPickleError: The file holds objects that only a full unpickle builds, and ``trust_pickle`` is off.
    """
    path = Path(path)
    fused, aliases = fused or {}, aliases or {}
    if not path.exists():
        raise FileNotFoundError(f"weights_from={str(path)!r}: nothing there. Pass a checkpoint file or directory.")
    sharded = path.is_dir() and (path / ".metadata").is_file()
    source: SlicedSource | None = None
    if sharded:
        found = stored_shapes(path)
    else:
        source = _open_sliced(path, trust_pickle)
        found = source.shapes()
        if stored_per_expert(found) and any(_FUSED_EXPERTS.search(name) for name in whole_shapes):
            # Experts stored one module each (the Hub's layout), held fused: read through transformers' own mapping.
            converted = PerExpertSource.for_directory(path, source)
            if converted is not None:
                source, found = converted, converted.shapes()
    if unwrapped_names and _holds_base_model(found, whole_shapes, unwrapped_names):
        whole_shapes, targets, fused = (_unwrapped(m, unwrapped_names, adapters) for m in (whole_shapes, targets, fused))
        aliases = {unwrapped_names.get(k, k): unwrapped_names.get(v, v) for k, v in aliases.items() if k not in adapters}
    prefix = _prefix(found, whole_shapes)
    expected = {k[len(prefix):]: v for k, v in whole_shapes.items() if k.startswith(prefix)}
    stored_alias = {k[len(prefix):]: v[len(prefix):] for k, v in aliases.items() if k.startswith(prefix) and v.startswith(prefix)}
    # A tied weight stored under one of its names only is complete.
    present = {**found, **{k: found[v] for k, v in stored_alias.items() if k not in found and v in found}}
    message = describe_mismatch(expected, present, strict=True)
    if message:
        raise RuntimeError(
            f"weights_from={str(path)!r} does not fit this model (names relative to {prefix or 'the module'!r}): "
            f"{message}. {_fix_for(expected, present)}"
        )
    wanted = {}
    for name in targets:
        stored = name[len(prefix):] if name.startswith(prefix) else None
        if stored in found:
            wanted[name] = stored
        elif stored in stored_alias and stored_alias[stored] in found:
            wanted[name] = stored_alias[stored]
        # else: a buffer that is not saved (non-persistent), or a tensor outside the stored module
    if sharded:
        _load_sharded(path, targets, fused, wanted, trust_pickle)
    else:
        for name, stored in wanted.items():
            _copy_sliced(source, stored, targets[name], fused.get(name))  # type: ignore[arg-type]
    return list(wanted)


#: A Mixture-of-Experts layer stored one module per expert (``...experts.3.w1.weight``, as Hugging Face checkpoints
#: keep them) and one built as fused 3-D parameters (``...experts.gate_up_proj``, as transformers 5 builds them).
_EXPERT_PER_MODULE = re.compile(r"\.experts\.\d+\.")
_FUSED_EXPERTS = re.compile(r"\.experts\.[A-Za-z_]+$")


def _holds_base_model(found: Mapping[str, tuple[int, ...]], whole: Mapping[str, tuple[int, ...]],
                      unwrapped_names: Mapping[str, str]) -> bool:
    """The source stores the model as it was before its projections were wrapped with adapters (none of the wrapped
    names, some of the unwrapped ones)."""
    prefix = _prefix(found, whole)
    if any(name[len(prefix):] in found for name in unwrapped_names if name.startswith(prefix)):
        return False
    prefix = _prefix(found, {unwrapped_names.get(k, k): v for k, v in whole.items()})
    return any(name[len(prefix):] in found for name in unwrapped_names.values() if name.startswith(prefix))


def _unwrapped(mapping: Mapping[str, Any], unwrapped_names: Mapping[str, str], adapters: Collection[str]) -> dict[str, Any]:
    return {unwrapped_names.get(k, k): v for k, v in mapping.items() if k not in adapters}


def _fix_for(expected: Mapping[str, tuple[int, ...]], present: Mapping[str, tuple[int, ...]]) -> str:
    """What to do about a source that does not fit: the usual fix, or the one for per-expert MoE checkpoints."""
    fused = [k for k in set(expected) - set(present) if _FUSED_EXPERTS.search(k)]
    per_expert = [k for k in set(present) - set(expected) if _EXPERT_PER_MODULE.search(k)]
    if fused and per_expert:
        return (
            "The source stores each expert as a module of its own, as Hugging Face checkpoints of Mixture-of-Experts "
            "models do, and the model holds them fused (transformers converts them in from_pretrained). weights_from "
            "converts them through transformers' conversion mapping for the model type in the directory's config.json, "
            "and this directory has none it can read (no config.json, or a mapping with operations other than stacking "
            "the experts and joining gate and up). Build the model with from_pretrained(path) instead (every rank then "
            "reads the whole checkpoint), or pass a checkpoint this library saved."
        )
    return "Build the model from the same configuration the weights were saved with."


def _prefix(found: Mapping[str, tuple[int, ...]], whole: Mapping[str, tuple[int, ...]]) -> str:
    """The prefix of the module's names under which the stored names lie ("" when they match as they are)."""
    if not found or any(name in whole for name in found):
        return ""
    sample = next(iter(sorted(found)))
    candidates = {name[: -len(sample)] for name in whole if name.endswith("." + sample)}
    best = max(candidates, key=lambda p: sum(p + n in whole for n in found), default="")
    return best


def _copy_sliced(source: SlicedSource, stored: str, target: Tensor, layout: Any) -> None:
    """Read the part of ``stored`` that ``target`` holds (all of it for rank-major fused layers)."""
    if layout is not None:
        copy_whole_into(target, layout.to_rank_major(source.read(stored, None)))
    else:
        copy_part_into(target, lambda index: source.read(stored, index))


def _load_sharded(path: Path, targets: Mapping[str, Tensor], fused: Mapping[str, Any], wanted: Mapping[str, str], trust_pickle: bool) -> None:
    """DCP reads, for each target, the chunks it covers (rank-major fused layers: the whole tensor)."""
    dtypes = {k.removeprefix(MODEL_KEY + "."): getattr(torch, v["dtype"]) for k, v in stored_tensors(path).items()}
    staged: dict[str, Tensor] = {}
    for name, stored in wanted.items():
        target = targets[name]
        if stored in staged:
            continue
        if name in fused:
            staged[stored] = torch.empty(tuple(target.shape), dtype=dtypes[stored], device="cpu")
        elif target.dtype != dtypes[stored]:
            staged[stored] = torch.empty_like(target, dtype=dtypes[stored])  # a DTensor keeps its placements
        else:
            staged[stored] = target
    load_states({MODEL_KEY: staged}, path, allow_partial=True, trust_pickle=trust_pickle, opt_in=OPT_IN)
    with torch.no_grad():
        for name, stored in wanted.items():
            target, value = targets[name], staged[stored]
            if value is not target:
                layout = fused.get(name)
                copy_whole_into(target, layout.to_rank_major(value) if layout is not None else value)


def _open_sliced(path: Path, trust_pickle: bool = False) -> SlicedSource:
    if path.is_file() and path.suffix == ".safetensors":
        return SafetensorsFiles({None: path})
    if path.is_dir():
        index = path / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return SafetensorsFiles({name: path / file for name, file in weight_map.items()})
        files = sorted(path.glob("*.safetensors"))
        if len(files) == 1:
            return SafetensorsFiles({None: files[0]})
        raise ValueError(
            f"weights_from={str(path)!r} is a directory with {len(files)} .safetensors files and no {SAFETENSORS_INDEX}, "
            "and not a sharded checkpoint: pass a Hugging Face model directory, a sharded checkpoint or a checkpoint file."
        )
    return TorchFile(path, trust_pickle)


class SafetensorsFiles:
    """Tensors in ``.safetensors`` files; ``files`` maps each name to its file (``None``: all in one)."""

    def __init__(self, files: Mapping[str | None, Path]) -> None:
        from safetensors import safe_open

        self._handles = {str(p): safe_open(str(p), framework="pt") for p in set(files.values())}
        if None in files:
            (handle,) = self._handles.values()
            self._where = {name: handle for name in handle.keys()}
        else:
            self._where = {name: self._handles[str(p)] for name, p in files.items()}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(handle.get_slice(name).get_shape()) for name, handle in self._where.items()}

    def read(self, name: str, index: tuple[slice, ...] | None) -> Tensor:
        part = self._where[name].get_slice(name)
        return part[index] if index is not None else part[:]


class TorchFile:
    """A ``torch.save`` file (a Lightning checkpoint's ``state_dict``, or a plain state dict), memory-mapped;
    refused if it holds objects that only a full unpickle builds, unless ``trust_pickle``."""

    def __init__(self, path: Path, trust_pickle: bool = False) -> None:
        try:
            loaded = load_file(path, trust_pickle=trust_pickle, opt_in=OPT_IN, map_location="cpu", mmap=True)
        except UntrustedPickleError:
            raise
        except Exception as error:
            raise ValueError(
                f"weights_from={str(path)!r} could not be read as a checkpoint file ({type(error).__name__}: {error}); "
                "pass a checkpoint file, a sharded checkpoint directory or a Hugging Face model directory."
            ) from error
        state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
        if not isinstance(state, dict):
            raise ValueError(f"weights_from={str(path)!r} holds a {type(loaded).__name__}, not a state dict or a Lightning checkpoint.")
        self._tensors = {k: v for k, v in state.items() if isinstance(v, Tensor)}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self._tensors.items()}

    def read(self, name: str, index: tuple[slice, ...] | None) -> Tensor:
        value = self._tensors[name]
        return value[index] if index is not None else value
