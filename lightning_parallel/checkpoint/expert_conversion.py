"""A Hugging Face Mixture-of-Experts checkpoint stored one module per expert, read as the fused experts a model holds.

The Hub keeps a MoE layer's experts as modules of their own (``...block_sparse_moe.experts.3.w1.weight``), while
transformers 5 builds them as 3-D parameters (``...mlp.experts.gate_up_proj [E, 2·I, H]``) and converts in
``from_pretrained``. transformers publishes that conversion per model type
(``transformers.conversion_mapping.get_checkpoint_conversion_mapping``): renamings of the names, and converters
that stack the experts (``MergeModulelist``) and join gate and up (``Concatenate``). :class:`PerExpertSource` reads a
directory through that mapping: it presents the fused names and shapes, and reads a fused tensor's slice by reading
only the experts that slice covers — under expert parallelism, each rank reads its own experts' files only.

A mapping with other operations (transposes, interleaving, quantised experts) is not interpreted: the caller keeps
its refusal. transformers is imported only when a checkpoint needs it. No Lightning here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class _Fused:
    """One fused tensor: for each expert, the stored names whose rows are concatenated (gate then up)."""

    experts: list[list[str]]
    shape: tuple[int, ...]


class PerExpertSource:
    """``source`` (a sliced reader of stored tensors) seen through a per-expert → fused conversion.

    Names the conversion does not touch are passed through (renamed where the mapping renames them).
    """

    def __init__(self, source: Any, renamings: list[tuple[str, str]], converters: list[tuple[list[str], str]]) -> None:
        self._source = source
        stored = source.shapes()
        self._plain: dict[str, str] = {}  # presented name -> stored name
        groups: dict[tuple[str, int], dict[int, dict[int, str]]] = {}  # (prefix, converter) -> source -> expert -> name
        for name in stored:
            renamed = name
            for pattern, target in renamings:
                renamed = re.sub(pattern, target, renamed)
            found = _converted(renamed, converters)
            if found is None:
                self._plain[renamed] = name
                continue
            prefix, converter, source_index, expert = found
            groups.setdefault((prefix, converter), {}).setdefault(source_index, {})[expert] = name
        self._fused: dict[str, _Fused] = {}
        for (prefix, converter), by_source in groups.items():
            sources, target = converters[converter]
            counts = {len(by_expert) for by_expert in by_source.values()}
            complete = len(by_source) == len(sources) and len(counts) == 1 and all(
                sorted(by_expert) == list(range(len(by_expert))) for by_expert in by_source.values())
            if not complete:  # leave them as stored: the caller lists what does not fit
                self._plain.update({n: n for by_expert in by_source.values() for n in by_expert.values()})
                continue
            experts = [[by_source[i][e] for i in range(len(sources))] for e in range(counts.pop())]
            rows = sum(stored[n][0] for n in experts[0])
            self._fused[prefix + target] = _Fused(experts, (len(experts), rows, *stored[experts[0][0]][1:]))

    @classmethod
    def for_directory(cls, path: Path, source: Any) -> PerExpertSource | None:
        """The converting reader of a Hugging Face directory whose experts are stored per module, or ``None`` where
        it has none, its ``config.json`` names no model type, or transformers' mapping for it uses operations this
        does not interpret."""
        config = path / "config.json" if path.is_dir() else None
        if config is None or not config.is_file():
            return None
        model_type = json.loads(config.read_text()).get("model_type")
        mapping = _mapping(model_type) if isinstance(model_type, str) else None
        if not mapping:
            return None
        converted = cls(source, *mapping)
        return converted if converted._fused else None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        stored = self._source.shapes()
        return {**{k: stored[v] for k, v in self._plain.items()}, **{k: f.shape for k, f in self._fused.items()}}

    def read(self, name: str, index: tuple[slice, ...] | None) -> Tensor:
        fused = self._fused.get(name)
        if fused is None:
            return self._source.read(self._plain[name], index)
        experts = range(len(fused.experts))[index[0]] if index is not None else range(len(fused.experts))
        # Only the experts this slice covers are read; each is small next to the layer.
        value = torch.stack([torch.cat([self._source.read(n, None) for n in fused.experts[e]]) for e in experts])
        return value[(slice(None), *index[1:])] if index is not None else value


def _converted(name: str, converters: list[tuple[list[str], str]]) -> tuple[str, int, int, int] | None:
    """``(prefix, converter, source, expert)`` where ``name`` is one expert's tensor of a converter's source."""
    for converter, (sources, _) in enumerate(converters):
        for source_index, pattern in enumerate(sources):
            match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)") + "$", name)
            if match is not None:
                return name[: match.start()], converter, source_index, int(match.group(1))
    return None


def _mapping(model_type: str) -> tuple[list[tuple[str, str]], list[tuple[list[str], str]]] | None:
    """transformers' checkpoint conversion for ``model_type`` as (renamings, converters), or ``None`` where it uses
    anything but plain renamings and experts stacked (``MergeModulelist(dim=0)``), then joined along their rows
    (``Concatenate(dim=1)``)."""
    try:
        from transformers import conversion_mapping
    except ImportError:
        return None
    transforms = conversion_mapping.get_checkpoint_conversion_mapping(model_type) or []
    renamings: list[tuple[str, str]] = []
    converters: list[tuple[list[str], str]] = []
    for transform in transforms:
        sources, targets = list(transform.source_patterns), list(transform.target_patterns)
        operations = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(transform, "operations", None) or []]
        if type(transform).__name__ == "WeightRenaming" and len(sources) == len(targets) == 1 and not operations:
            renamings.append((sources[0], targets[0]))
        elif (type(transform).__name__ == "WeightConverter" and len(targets) == 1
              and all(source.count("*") == 1 for source in sources)
              and operations in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])
              and (len(sources) == 1) == (len(operations) == 1)):
            converters.append((sources, targets[0]))
        else:
            return None
    return (renamings, converters) if converters else None


def stored_per_expert(names: Mapping[str, Any]) -> bool:
    """Whether any stored name is one expert's module (``...experts.3.w1.weight``)."""
    return any(re.search(r"\.experts\.\d+\.", name) for name in names)
