"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), readable under any layout.

On disk (Lightning's layout for sharded checkpoints, so its own tools read ours too)::

    step=8.ckpt/
        .metadata          DCP: every tensor's whole shape and which file holds which chunk
        __0_0.distcp ...   DCP: each rank's shards (replicated tensors written once)
        meta.pt            Lightning's non-tensor state (loops, callbacks, schedulers) + who wrote it

Tensors are keyed ``state_dict.<parameter name>`` and ``optimizer_<i>.state.<parameter name>.<field>``
by the module's original parameter names, whatever the layout that wrote them, so any layout can read
what any other wrote: DCP reads for each rank just the chunks its own shards cover.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_parallel.checkpoint.files import META_FILENAME, checkpoint_format
from lightning_parallel.checkpoint.state import (
    MISMATCH_HINT,
    describe_mismatch,
    listing,
)
from lightning_parallel.checkpoint.unpickling import (
    DEFAULT_OPT_IN,
    CheckedReader,
    UntrustedPickleError,
    checked_planner,
    load_file,
)

MODEL_KEY = "state_dict"
#: Other model states a checkpoint may hold beside ``MODEL_KEY``, stored as tensors like it (Lightning's WeightAveraging
#: writes the averaged weights as ``state_dict`` and the module's own under ``current_model_state``).
EXTRA_MODEL_KEYS = ("current_model_state",)


def optimizer_key(index: int) -> str:
    """The top-level key of the ``index``-th optimizer's state (Lightning's naming)."""
    return f"optimizer_{index}"


def save_states(
    states: dict[str, Any],
    directory: str | os.PathLike,
    *,
    process_group: dist.ProcessGroup | None = None,
    asynchronous: bool = False,
) -> Future | None:
    """Write each rank's part of ``states`` into ``directory`` (a collective: every rank calls it).

    With ``asynchronous=True`` the tensors are first copied to host memory, then written by a background
    thread: the returned future completes when this rank's files and (on the coordinator) the metadata
    are written. ``process_group`` should then be a group used for nothing else (the thread runs collectives).
    """
    if asynchronous:
        return dcp.async_save(states, checkpoint_id=directory, process_group=process_group)
    dcp.save(states, checkpoint_id=directory, process_group=process_group)
    return None


def read_meta(directory: str | os.PathLike, weights_only: bool | None = None, opt_in: str = DEFAULT_OPT_IN) -> dict[str, Any]:
    """The non-tensor part (``meta.pt``) of a sharded checkpoint (checked complete and not cut short first).

    ``weights_only=False`` unpickles it in full (for checkpoints you trust); ``None`` or ``True`` refuse
    objects that could run code (``checkpoint/unpickling.py``), naming ``opt_in`` as the way to allow them.
    """
    _read_metadata(directory)
    with reading(directory):
        return load_file(Path(directory) / META_FILENAME, trust_pickle=weights_only is False, opt_in=opt_in, map_location="cpu")


def stored_shapes(directory: str | os.PathLike, prefix: str = MODEL_KEY) -> dict[str, tuple[int, ...]]:
    """Whole shape of every tensor stored under ``prefix`` (``state_dict``: the model), by name."""
    metadata = _read_metadata(directory)
    start = prefix + "."
    return {
        key[len(start):]: tuple(entry.size)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(start) and isinstance(entry, TensorStorageMetadata)
    }


def stored_tensors(directory: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Every stored tensor by flattened key: whole shape, dtype, and how many chunks (shards) hold it."""
    return {
        key: {"shape": list(entry.size), "dtype": str(entry.properties.dtype).removeprefix("torch."), "chunks": len(entry.chunks)}
        for key, entry in _read_metadata(directory).state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }


def stored_keys(directory: str | os.PathLike) -> set[str]:
    """Every flattened key stored in a sharded checkpoint (``state_dict.<name>``, ``optimizer_0.state...``)."""
    return set(_read_metadata(directory).state_dict_metadata)


def check_model_fits(directory: str | os.PathLike, expected: Mapping[str, tuple[int, ...]], strict: bool) -> None:
    """Refuse, before anything is read, a checkpoint whose model tensors differ from ``expected``.

    Raises:
        RuntimeError: Missing or unexpected names (when ``strict``) or different shapes; all listed.
    """
    message = describe_mismatch(expected, stored_shapes(directory), strict)
    if message:
        raise RuntimeError(f"The checkpoint {str(directory)!r} does not fit this model: {message}. {MISMATCH_HINT}")


def check_optimizer_fits(directory: str | os.PathLike, key: str, target: Mapping[str, Any], optimizer_name: str) -> None:
    """Refuse an optimizer state that lacks entries ``target`` (this rank's, by parameter name) needs."""
    stored = stored_keys(directory)
    wanted = {
        f"{key}.state.{name}.{field}"
        for name, fields in target["state"].items()
        for field, value in fields.items()
        if isinstance(value, torch.Tensor)
    }
    missing = sorted(wanted - stored)
    if missing:
        raise RuntimeError(
            f"The optimizer state in {str(directory)!r} does not fit {optimizer_name} over this model: missing "
            f"{listing(missing)}. Resume with the optimizer "
            "it was saved with (configure_optimizers), or load the weights only."
        )


def load_states(
    states: dict[str, Any],
    directory: str | os.PathLike,
    *,
    allow_partial: bool = False,
    trust_pickle: bool = False,
    opt_in: str = DEFAULT_OPT_IN,
) -> None:
    """Fill ``states`` (this rank's tensors, any sharding) in place from a sharded checkpoint (a collective).

    Non-tensor values (``param_groups``) are refused if they could run code, unless ``trust_pickle``.
    """
    planner = checked_planner(DefaultLoadPlanner, source=directory, trust_pickle=trust_pickle, opt_in=opt_in, allow_partial_load=allow_partial)
    with reading(directory):
        dcp.load(states, storage_reader=CheckedReader(directory), planner=planner)


def read_whole(directory: str | os.PathLike, weights_only: bool | None = None, opt_in: str = DEFAULT_OPT_IN) -> dict[str, Any]:
    """A sharded checkpoint as the ordinary Lightning checkpoint dict, whole tensors (one process, no peers).

    ``state_dict`` loads into the plain module; ``optimizer_states`` are keyed by parameter names in the
    optimizer's order, which ``torch.optim.Optimizer.load_state_dict`` maps by position. ``weights_only`` and
    ``opt_in`` as :func:`read_meta`.
    """
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint = read_meta(directory, weights_only, opt_in)
    states: dict[str, Any] = {}
    planner = checked_planner(_EmptyStateDictLoadPlanner, source=directory, trust_pickle=weights_only is False, opt_in=opt_in)
    with reading(directory):
        _load_state_dict(states, storage_reader=CheckedReader(directory), planner=planner, no_dist=True)
    checkpoint[MODEL_KEY] = states.pop(MODEL_KEY, {})
    count = len([key for key in states if key.startswith("optimizer_")])
    checkpoint["optimizer_states"] = [states.pop(optimizer_key(i)) for i in range(count)]
    checkpoint.update(states)
    return checkpoint


def write_whole(checkpoint: Mapping[str, Any], directory: str | os.PathLike) -> None:
    """Write a Lightning checkpoint dict of whole tensors as a sharded checkpoint, from this one process."""
    states, meta = whole_to_states(checkpoint)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(states, checkpoint_id=directory, no_dist=True)
    torch.save(meta, Path(directory) / META_FILENAME)


def whole_to_states(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a Lightning checkpoint dict into DCP tensor states and the ``meta.pt`` rest (for conversion)."""
    meta = dict(checkpoint)
    states = {MODEL_KEY: meta.pop(MODEL_KEY)}
    for key in EXTRA_MODEL_KEYS:
        if key in meta:
            states[key] = meta.pop(key)
    for index, optimizer_state in enumerate(meta.pop("optimizer_states", [])):
        states[optimizer_key(index)] = optimizer_state
    return states, meta


@contextmanager
def reading(path: str | os.PathLike) -> Iterator[None]:
    """Turn a failure to read ``path`` into one clear error instead of a deep torch traceback."""
    try:
        yield
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, pickle.UnpicklingError, CheckpointException) as error:
        untrusted = _cause(error, lambda e: isinstance(e, UntrustedPickleError))
        if untrusted is not None:
            raise untrusted from None
        missing = _cause(error, lambda e: str(e).startswith(_DCP_MISSING_KEY))
        if missing is not None:  # a whole checkpoint that lacks what this run asks for: not a damaged one
            name = str(missing)[len(_DCP_MISSING_KEY):].strip().rstrip(".")
            raise RuntimeError(
                f"The checkpoint {str(path)!r} holds no {name!r}, which this run loads: it was saved from another "
                f"model or configuration; nothing was loaded. {MISMATCH_HINT}"
            ) from None
        if isinstance(error, FileNotFoundError) and not Path(path).exists():
            raise FileNotFoundError(f"No checkpoint at {str(path)!r}.") from error
        if str(error).startswith("The checkpoint ") or "weights_only" in str(error):  # already clear
            raise
        detail = str(error).strip().splitlines()
        raise RuntimeError(
            f"The checkpoint {str(path)!r} could not be read ({type(error).__name__}: {detail[-1] if detail else ''}). "
            "It is corrupt or incomplete (a truncated copy, a save that did not finish); nothing was loaded. "
            "Resume from an earlier checkpoint."
        ) from error


#: How DCP's load planner says the checkpoint lacks a key the state to fill has.
_DCP_MISSING_KEY = "Missing key in checkpoint state_dict:"


def _cause(error: BaseException, wanted: Callable[[BaseException], bool]) -> BaseException | None:
    """The error behind ``error`` that is ``wanted`` (DCP wraps each rank's errors in a CheckpointException)."""
    if wanted(error):
        return error
    if isinstance(error, CheckpointException):
        for failure, _trace in error.failures.values():
            found = _cause(failure, wanted) if isinstance(failure, BaseException) else None
            if found is not None:
                return found
    cause = error.__cause__ or error.__context__
    return _cause(cause, wanted) if cause is not None and cause is not error else None


def _read_metadata(directory: str | os.PathLike) -> Metadata:
    """DCP's metadata, once the directory is known complete and no file it points into is cut short."""
    checkpoint_format(directory)  # a clear error for a missing path or an unfinished directory
    with reading(directory):
        metadata = CheckedReader(directory).read_metadata()
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        file = Path(directory) / name
        actual = file.stat().st_size if file.is_file() else None
        if actual is None or actual < size:
            found = "missing" if actual is None else f"{actual} bytes, {size} expected"
            raise RuntimeError(
                f"The checkpoint {str(directory)!r} is corrupt or incomplete: its file {name} is {found} "
                "(a truncated copy, or a save that did not finish); nothing was loaded. Resume from an earlier checkpoint."
            )
    return metadata
