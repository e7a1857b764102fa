"""Export a checkpoint of this library as a Hugging Face model directory, in this one process.

    python -m lightning_parallel.checkpoint export last.ckpt hf-model/ --format hf [--config CONFIG]
        [--prefix net.] [--max-shard-size 5GB] [--dtype bfloat16] [--overwrite] [--no-original-format]

Either checkpoint format, written under any layout: both hold every tensor by the module's own names, whole
(``full``) or as shards whose whole shapes DCP records (``sharded``), and fused projections in the module's
order (the rank-major order tensor parallelism trains with never reaches a checkpoint). Tensors are read one
output file at a time (memory-mapped for a full checkpoint, DCP reads of just those tensors for a sharded one).

What is written: ``config.json`` (and ``generation_config.json`` for generative models), the weights as
``model.safetensors`` or, past ``max_shard_size``, ``model-00001-of-0000N.safetensors`` with
``model.safetensors.index.json``. Names lose the LightningModule's prefix (``net.``: the attribute holding the
Hugging Face model), and a tied weight is written once, under the name ``from_pretrained`` expects (a tied
``lm_head.weight`` is left out, as ``save_pretrained`` does). Families that transformers converts on load (Mixture of
Experts: fused experts in memory, one module per expert on the Hub) are written in the Hub's layout by transformers'
own reverse conversion, group by group (``hub_layout.py``), as ``save_pretrained`` writes them.

The Hugging Face config is not part of a Lightning checkpoint unless the LightningModule saved it among its
hyperparameters (a ``PretrainedConfig`` or its ``to_dict()``): otherwise pass ``config`` (a ``config.json``,
a model directory, or a hub name). The model is then built on the meta device only to learn its names, shapes
and tied weights; the checkpoint must hold exactly those under the prefix (anything outside it, such as a
loss module's buffers, is left out and counted).

The checkpoint is read without running code from it: objects that only a full unpickle builds (a
``PretrainedConfig`` among the hyperparameters, say) are refused unless ``trust_pickle`` (``--trust-pickle``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_parallel.checkpoint import hub_layout
from lightning_parallel.checkpoint.files import checkpoint_format
from lightning_parallel.checkpoint.sharded import (
    MODEL_KEY,
    read_meta,
    reading,
    stored_tensors,
)
from lightning_parallel.checkpoint.state import describe_mismatch, listing
from lightning_parallel.checkpoint.unpickling import CheckedReader, load_file

EXPORT_FORMATS = ("hf",)
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
#: Weight files of a previous export: the only files ``overwrite=True`` removes (stale shards would be loaded).
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
#: Tokenizer files copied along when ``config`` is a model directory.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
)
#: How a refusal to unpickle names the opt-in (this module's and the command line's).
OPT_IN = "--trust-pickle (trust_pickle=True from Python)"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass
class ExportSummary:
    """What :func:`export_hf` wrote."""

    directory: Path
    files: list[str]
    tensors: int
    bytes: int
    prefix: str
    config_from: str
    tied_left_out: list[str] = field(default_factory=list)
    outside_prefix: int = 0
    #: The model's tensors written under other names or split (the Hub layout: per-expert modules of fused experts).
    converted: int = 0


def export(checkpoint: str | os.PathLike, directory: str | os.PathLike, format: str = "hf", **options: Any) -> ExportSummary:
    """Export ``checkpoint`` into ``directory`` in ``format`` (only ``"hf"`` so far; see :func:`export_hf`)."""
    if format != "hf":
        raise ValueError(f"format={format!r} is unknown; choose one of {', '.join(EXPORT_FORMATS)}.")
    return export_hf(checkpoint, directory, **options)


def export_hf(
    checkpoint: str | os.PathLike,
    directory: str | os.PathLike,
    *,
    config: str | os.PathLike | Any | None = None,
    prefix: str | None = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
    trust_pickle: bool = False,
    original_format: bool = True,
) -> ExportSummary:
    """Write a Hugging Face model directory that ``from_pretrained`` loads with the checkpoint's weights.

    Args:
        checkpoint: A checkpoint of either format (a file, or a sharded checkpoint directory).
        directory: Where to write; created. Must be empty or absent unless ``overwrite``.
        config: The Hugging Face config: a ``PretrainedConfig``, a ``config.json``, a directory holding one
            (its tokenizer files are copied too) or a hub name. ``None``: the one among the checkpoint's
            hyperparameters.
        prefix: Removed from the checkpoint's names (``"net."``); ``None``: found by matching the model's names.
        max_shard_size: Bytes per weight file (``"5GB"``, ``"500MB"``, ``"2GiB"`` or an int); a larger single
            tensor gets a file of its own.
        dtype: Convert floating-point tensors to it (``None``: keep each tensor's dtype).
        overwrite: Write into a non-empty ``directory``: only files of the same names and earlier weight files
            (``model*.safetensors*``) are replaced or removed, nothing else.
        trust_pickle: Unpickle the checkpoint in full, which runs any code the file names (only for files you trust).
        original_format: Write the Hub's layout, as ``save_pretrained`` does: families that transformers converts on
            load (Mixture-of-Experts experts fused in memory, one module per expert on the Hub) are converted back by
            transformers' own reverse conversion (``hub_layout.py``). ``False``: the model's in-memory names and
            fused tensors (transformers 5 loads those too; other readers of the Hub layout may not).

    Raises:
        FileNotFoundError: No checkpoint at ``checkpoint``, or no config at ``config``.
        FileExistsError: ``directory`` is not empty and ``overwrite`` is off (nothing written).
        UntrustedPickleError: The checkpoint holds objects only a full unpickle builds, and ``trust_pickle`` is off.
        ValueError: No config found, a ``prefix`` that matches nothing, or the checkpoint's tensors do not fit the
            config's model (missing, unexpected and mis-shaped names listed); nothing is written then.
    """
    checkpoint, directory = Path(checkpoint), Path(directory)
    limit = parse_size(max_shard_size)
    out_dtype = _dtype(dtype)
    source = _open(checkpoint, trust_pickle)
    if directory.exists() and (not directory.is_dir() or (any(directory.iterdir()) and not overwrite)):
        raise FileExistsError(
            f"{str(directory)!r} exists and is not an empty directory; choose a new one or pass overwrite "
            "(--overwrite), which replaces only the files an export writes. Nothing was written."
        )
    hf_config, config_from, tokenizer_dir = _resolve_config(config, source.hyper_parameters, checkpoint)
    model = _meta_model(hf_config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    aliases = tied_aliases(model)  # left-out name -> the name it is written under
    found = source.shapes()
    prefix = _find_prefix(found, expected, prefix, checkpoint)
    stripped = {name[len(prefix):]: shape for name, shape in found.items() if name.startswith(prefix)}
    present = {**stripped, **{k: stripped[v] for k, v in aliases.items() if k not in stripped and v in stripped}}
    message = describe_mismatch(expected, present, strict=True)
    if message:
        raise ValueError(
            f"The checkpoint {str(checkpoint)!r} does not fit the {type(model).__name__} its config builds (names after "
            f"removing {prefix!r}): {message}. Pass the config the model was trained with (config), or the right prefix."
        )
    written = [name for name in expected if name not in aliases]  # the module's own order
    groups = _groups(model, {name: (expected[name], source.dtype(prefix + name)) for name in written}, original_format)
    outputs = {out: shape_dtype for group in groups for out, shape_dtype in group.outputs.items()}
    dtypes = {out: out_dtype if out_dtype is not None and dtype.is_floating_point else dtype for out, (_, dtype) in outputs.items()}
    sizes = {out: _numel(shape) * dtypes[out].itemsize for out, (shape, _) in outputs.items()}
    shards = _split(groups, sizes, limit)
    files = [SAFE_WEIGHTS_NAME] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    directory.mkdir(parents=True, exist_ok=True)
    _remove_previous_weights(directory, keep=set(files))
    from safetensors.torch import save_file

    checked_aliases = {k: v for k, v in aliases.items() if k in stripped and v in stripped}
    for shard, file in zip(shards, files):
        names = [n for group in shard for n in group.inputs]
        extra = [k for k, v in checked_aliases.items() if v in names]
        values = source.read([prefix + n for n in names + extra])
        for left_out in extra:
            kept = checked_aliases[left_out]
            if not torch.equal(values[prefix + left_out], values[prefix + kept]):
                raise ValueError(
                    f"The config ties {left_out!r} to {kept!r}, but the checkpoint holds different values for them (the model "
                    f"was trained untied). Pass a config with tie_word_embeddings=False. {str(directory)!r} is incomplete."
                )
        tensors = {
            out: value.to(dtypes[out]).contiguous() for group in shard
            for out, value in hub_layout.converted(model, group, {n: values[prefix + n] for n in group.inputs}).items()
        }
        _atomic(directory / file, lambda path, t=tensors: save_file(t, str(path), metadata={"format": "pt"}))
        del values, tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": {n: f for shard, f in zip(shards, files) for g in shard for n in g.outputs}}
        _atomic(directory / SAFE_WEIGHTS_INDEX_NAME, lambda path: path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n"))
    hf_config.architectures = [type(model).__name__]
    hf_config.dtype = _most_common(dtypes.values())
    hf_config.save_pretrained(directory)
    extra_files = ["config.json"]
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
        extra_files.append("generation_config.json")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, directory / name)
                extra_files.append(name)
    return ExportSummary(
        directory=directory,
        files=files + ([SAFE_WEIGHTS_INDEX_NAME] if len(files) > 1 else []) + extra_files,
        tensors=len(outputs),
        bytes=sum(sizes.values()),
        prefix=prefix,
        config_from=config_from,
        tied_left_out=sorted(aliases),
        outside_prefix=len(found) - len(stripped),
        converted=sum(len(group.inputs) for group in groups if group.renamed),
    )


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a number with a unit (``5GB`` = 5·10⁹, ``2GiB`` = 2·2³⁰, ``500MB``, ``10KB``)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if unit not in _UNITS:
            raise ValueError(f"max_shard_size={size!r} is not a size: write bytes (1000000) or a number with a unit (5GB, 500MB, 2GiB).")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be positive.")
    return value


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Names of tied tensors left out of the files -> the name each is stored under (as ``save_pretrained``).

    Tensors are tied when the module holds one object under several names; of those, the names declared in
    ``_tied_weights_keys`` (the tied copies, such as ``lm_head.weight``) are left out.
    """
    declared = [f"{prefix}.{key}" if prefix else key for prefix, sub in model.named_modules() for key in (getattr(sub, "_tied_weights_keys", None) or {})]
    groups: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(tensor), []).append(name)
    state = set(model.state_dict())
    aliases = {}
    for names in groups.values():
        names = [n for n in names if n in state]
        if len(names) < 2:
            continue
        copies = [n for n in names if any(re.fullmatch(pattern, n) or pattern == n for pattern in declared)]
        kept = next((n for n in names if n not in copies), names[0])
        aliases.update({n: kept for n in names if n != kept})
    return aliases


class _Source:
    """A checkpoint's model tensors by name, read a few at a time."""

    def __init__(self, path: Path, trust_pickle: bool = False) -> None:
        self.path = path
        self.format = checkpoint_format(path)  # FileNotFoundError naming the path when nothing is there
        if self.format == "sharded":
            meta = read_meta(path, weights_only=not trust_pickle, opt_in=OPT_IN)
            start = MODEL_KEY + "."
            self._meta = {k[len(start):]: v for k, v in stored_tensors(path).items() if k.startswith(start)}
            self._tensors: Mapping[str, Tensor] = {}
        else:
            with reading(path):
                meta = load_file(path, trust_pickle=trust_pickle, opt_in=OPT_IN, map_location="cpu", mmap=True)
            state = meta.get(MODEL_KEY) if isinstance(meta, dict) else None
            if not isinstance(state, dict):
                raise ValueError(f"{str(path)!r} is not a Lightning checkpoint (no {MODEL_KEY!r} in it).")
            self._tensors = {k: v for k, v in state.items() if isinstance(v, Tensor)}
            self._meta = {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in self._tensors.items()}
        self.hyper_parameters: dict[str, Any] = dict(meta.get("hyper_parameters") or {})

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(entry["shape"]) for name, entry in self._meta.items()}

    def dtype(self, name: str) -> torch.dtype:
        return getattr(torch, self._meta[name]["dtype"])

    def read(self, names: list[str]) -> dict[str, Tensor]:
        if self.format == "full":
            return {name: self._tensors[name] for name in names}
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        values = {name: torch.empty(self._meta[name]["shape"], dtype=self.dtype(name)) for name in names}
        with reading(self.path), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            # Tensors only (no pickled items): DCP's planner will do; its index is read by the checked reader.
            dcp.load(
                {MODEL_KEY: values}, storage_reader=CheckedReader(self.path),
                planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True,
            )
        return values


def _open(path: Path, trust_pickle: bool = False) -> _Source:
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {str(path)!r}.")
    return _Source(path, trust_pickle)


def _resolve_config(config: Any, hyper_parameters: Mapping[str, Any], checkpoint: Path) -> tuple[Any, str, Path | None]:
    """The Hugging Face config to export with, where it came from, and a directory to copy tokenizer files from."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config.__class__.from_dict(config.to_dict()), "the given config", None
    if config is not None:
        path = Path(config)
        if path.is_file():
            return _config_from_dict(json.loads(path.read_text())), str(path), None
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"config={str(path)!r} is a directory without a config.json.")
            return AutoConfig.from_pretrained(path), str(path / "config.json"), path
        if str(config).count("/") <= 1 and not str(config).startswith((".", "/", "~")) and path.suffix != ".json":
            try:  # a hub name (or its local cache)
                return AutoConfig.from_pretrained(str(config)), str(config), None
            except OSError as error:
                raise FileNotFoundError(f"config={str(config)!r} is no file, directory or reachable hub model ({error}).") from error
        raise FileNotFoundError(f"config={str(config)!r}: nothing there. Pass a config.json, a model directory or a hub name.")
    for key, value in sorted(hyper_parameters.items(), key=lambda item: item[0] != "config"):
        if isinstance(value, PretrainedConfig):
            return value.__class__.from_dict(value.to_dict()), f"hyper_parameters[{key!r}]", None
        if isinstance(value, Mapping) and "model_type" in value:
            return _config_from_dict(dict(value)), f"hyper_parameters[{key!r}]", None
    raise ValueError(
        f"The checkpoint {str(checkpoint)!r} holds no Hugging Face config (none among its hyperparameters "
        f"{sorted(hyper_parameters)}): pass config (--config) as a config.json, the model directory the run started "
        "from, or a hub name; or save it with the LightningModule: self.save_hyperparameters({'config': self.net.config.to_dict()})."
    )


def _config_from_dict(values: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    values = dict(values)
    if "model_type" not in values:
        raise ValueError(f"The config {sorted(values)[:8]} has no model_type: pass a Hugging Face config.json.")
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _meta_model(config: Any) -> Any:
    """The config's model on the meta device (names, shapes, tied weights; no memory)."""
    import transformers
    from transformers import AutoModelForCausalLM

    architecture = (getattr(config, "architectures", None) or [None])[0]
    model_class = getattr(transformers, architecture, None) if architecture else None
    with torch.device("meta"):
        if model_class is not None:
            return model_class._from_config(config)
        return AutoModelForCausalLM.from_config(config)


def _find_prefix(found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], prefix: str | None, checkpoint: Path) -> str:
    """``prefix`` checked, or the one under which most of the model's names lie in the checkpoint."""
    first = listing(list(found), shown=5)
    if prefix is not None:
        if not any(name.startswith(prefix) for name in found):
            raise ValueError(f"prefix={prefix!r} matches none of the checkpoint's {first} model tensors; pass one of their prefixes (such as 'net.').")
        return prefix
    candidates: dict[str, int] = {}
    for name in found:
        for wanted in expected:
            if name == wanted or name.endswith("." + wanted):
                start = name[: len(name) - len(wanted)]
                candidates[start] = candidates.get(start, 0) + 1
    if not candidates:
        raise ValueError(
            f"None of the checkpoint's {first} model tensors ends with a name of the config's model ({listing(list(expected), shown=3)}): "
            "pass the config the model was trained with, or the prefix to remove (--prefix)."
        )
    best = max(candidates.values())
    top = sorted(p for p, count in candidates.items() if count == best)
    if len(top) > 1:
        raise ValueError(f"The model's names lie under several prefixes of the checkpoint's names ({top}): choose one (--prefix).")
    return top[0]


def _groups(model: Any, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]], original_format: bool) -> list[hub_layout.HubGroup]:
    """The tensors to write, in groups converted together (one tensor each unless the Hub layout joins some)."""
    if not original_format:
        return [hub_layout.HubGroup((name,), {name: value}, renamed=False) for name, value in tensors.items()]
    return hub_layout.plan(model, tensors)


def _split(groups: list[hub_layout.HubGroup], sizes: Mapping[str, int], limit: int) -> list[list[hub_layout.HubGroup]]:
    """Consecutive groups in files of at most ``limit`` bytes (a larger group alone in its file): a group's outputs
    share a file, so that each file is written from the tensors read for it."""
    shards: list[list[hub_layout.HubGroup]] = [[]]
    used = 0
    for group in groups:
        size = sum(sizes[out] for out in group.outputs)
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(group)
        used += size
    return shards


def _remove_previous_weights(directory: Path, keep: set[str]) -> None:
    """Remove weight files of an earlier export (``model*.safetensors*``) that this one does not replace."""
    for path in directory.iterdir():
        if path.is_file() and _WEIGHT_FILE.fullmatch(path.name) and path.name not in keep:
            path.unlink()


def _atomic(path: Path, write: Any) -> None:
    partial = path.with_name(f".{path.name}.partial")
    write(partial)
    os.replace(partial, path)


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating-point torch dtype (bfloat16, float16, float32, float64).")
    return value


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _most_common(dtypes: Any) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for dtype in dtypes:
        if dtype.is_floating_point:
            counts[dtype] = counts.get(dtype, 0) + 1
    return max(counts, key=counts.get, default=torch.float32)
