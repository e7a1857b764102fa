"""Read checkpoints without running code from them, unless the user says they trust the file.

A ``torch.save`` file is a pickle, and a full unpickle calls whatever functions the file names: a checkpoint
from elsewhere (downloaded pretrained weights, a shared run) could run anything, on every rank that reads
it. Every read of this library goes through here:

- ``torch.save`` files (full checkpoints, a sharded checkpoint's ``meta.pt``, the replica files of periodic
  sync, plain state dicts given as ``weights_from``) and the non-tensor items of a sharded checkpoint:
  ``torch.load(weights_only=True)`` with the few types our own checkpoints hold allowed beside torch's
  (:func:`checkpoint_types`);
- a sharded checkpoint's ``.metadata`` (DCP's index, a plain pickle): an unpickler that builds only DCP's
  metadata types, whatever the trust (torch writes nothing else there; :class:`CheckedReader`).

Anything else is refused with :class:`UntrustedPickleError`, which names the file, the type and the option
that opts in to a full unpickle (``trust_pickle=True`` beside ``weights_from``, ``--trust-pickle`` on the
command line, Lightning's ``weights_only=False`` for a resume). Nothing of the file has run by then.
"""

from __future__ import annotations

import collections
import functools
import os
import pickle
import re
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

#: The option named in errors where the caller names none.
DEFAULT_OPT_IN = "trust_pickle=True"


class UntrustedPickleError(pickle.UnpicklingError, ValueError):
    """A checkpoint holds a pickled object that only a full unpickle (which can run code) would build."""


def checkpoint_types() -> list[Any]:
    """The types our own checkpoints hold beyond what ``torch.load(weights_only=True)`` allows by default.

    Found by writing checkpoints the library's ways (``tests/unit/test_unpickling.py`` keeps the list honest):
    Lightning's checkpoints of plain modules need nothing more; the recipes' hyperparameters are the
    arguments Hydra instantiated, OmegaConf containers (``DictConfig``, ``ListConfig`` with ``AnyNode`` values,
    their ``ContainerMetadata``/``Metadata``), which refer to ``typing.Any``, ``int``, ``list`` and ``dict`` as
    types and keep a ``collections.defaultdict`` resolver cache. Building any of them runs no code of the file.
    """
    types: list[Any] = [typing.Any, int, list, dict, collections.defaultdict]
    try:
        from omegaconf import DictConfig, ListConfig
        from omegaconf.base import ContainerMetadata, Metadata
        from omegaconf.nodes import AnyNode
    except ImportError:  # without omegaconf no checkpoint can hold its containers anyway
        return types
    return [*types, DictConfig, ListConfig, ContainerMetadata, Metadata, AnyNode]


@contextmanager
def checked_unpickling(
    source: Any, *, trust_pickle: bool = False, opt_in: str = DEFAULT_OPT_IN, item: str | None = None
) -> Iterator[None]:
    """Around ``torch.load(weights_only=True)`` calls: our checkpoints' types allowed, a refusal explained.

    Args:
        source: The file (named in the error).
        trust_pickle: Allow everything (the caller loads with ``weights_only=False``): nothing is changed.
        opt_in: The option that would have allowed a full unpickle, as the user sets it.
        item: The part of the file being read, if not all of it (named in the error).

    Raises:
        UntrustedPickleError: torch's weights-only unpickler refused something (its type named).
    """
    if trust_pickle:
        yield
        return
    with torch.serialization.safe_globals(checkpoint_types()):
        try:
            yield
        except pickle.UnpicklingError as error:
            # torch >= 2.6 (checked on 2.13) opens its refusals with this sentence; other errors are damaged files.
            if isinstance(error, UntrustedPickleError) or "Weights only load failed" not in str(error):
                raise
            found = re.search(r"GLOBAL ([\w.]+)", str(error))
            what = f"`{found.group(1)}`" if found else "an object"
            raise untrusted(_shown(source, item), what, opt_in) from None


def load_file(source: str | os.PathLike | IO[bytes], *, trust_pickle: bool = False, opt_in: str = DEFAULT_OPT_IN, **kwargs: Any) -> Any:
    """``torch.load`` of a file or buffer, refusing (unless ``trust_pickle``) what could run code; see the module."""
    name = source if isinstance(source, (str, os.PathLike)) else "a checkpoint buffer"
    with checked_unpickling(name, trust_pickle=trust_pickle, opt_in=opt_in):
        return torch.load(source, weights_only=not trust_pickle, **kwargs)


def untrusted(shown: str, what: str, opt_in: str | None, where: str = "") -> UntrustedPickleError:
    """The refusal: which file (``shown``), which type (``what``, ``where`` in it), how to opt in, why one would not."""
    fix = f"pass {opt_in}, or allow just that type" if opt_in else "allow that type"
    return UntrustedPickleError(
        f"{shown} holds {what}{where}: a pickled object that only a full unpickle builds, and a full unpickle runs "
        "whatever code the file names (a checkpoint from elsewhere, downloaded or shared, could run anything on every "
        f"rank that reads it). Nothing from the file was run or loaded. If you trust this file, {fix} with "
        "torch.serialization.add_safe_globals([...]) before loading."
    )


def _shown(source: Any, item: str | None = None) -> str:
    return f"{str(source)!r}" + (f" (item {item})" if item else "")


# ---------------------------------------------------------------------------- DCP's index (.metadata)

#: Everything torch's DCP pickles into ``.metadata`` (checked on torch 2.13): its metadata dataclasses and
#: enum, each file's storage record, shapes, dtypes (looked up below), layouts and the checkpoint's path.
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata and nothing else (Python's documented way of restricting globals), plus what the user
    allowed with ``torch.serialization.add_safe_globals``."""

    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (
            (module, name) in _METADATA_GLOBALS
            or (module == "torch" and isinstance(vars(torch).get(name), torch.dtype))
            or f"{module}.{name}" in _user_allowed()
        ):
            return super().find_class(module, name)
        raise untrusted(
            _shown(self._source), f"`{module}.{name}`", None,
            " in its DCP index (.metadata), where torch writes only its own metadata types (so something else wrote "
            "it, or a newer torch than lightning_parallel knows: please report that)",
        )


def _user_allowed() -> set[str]:
    """Names of the globals allowed with ``torch.serialization.add_safe_globals`` (objects or (object, name) pairs)."""
    names = set()
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (entry, None)
        names.add(name or f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}")
    return names


class CheckedReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with an unpickler that builds only DCP's metadata types.

    No option opts in to a full unpickle here: torch writes nothing else into ``.metadata`` (a type the user
    allowed with ``torch.serialization.add_safe_globals`` is built too).
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        # FileSystemReader.read_metadata with the restricted unpickler (as of torch 2.13, whose private
        # _get_metadata_path also knows per-rank files; earlier versions read ".metadata" only).
        locate = getattr(self, "_get_metadata_path", None)
        path = locate(kwargs.get("rank")) if locate is not None else self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream, str(Path(self.path))).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def checked_planner(base: type, *, source: Any, trust_pickle: bool = False, opt_in: str = DEFAULT_OPT_IN, **kwargs: Any) -> Any:
    """A DCP load planner of class ``base`` (built with ``kwargs``) whose non-tensor items (``param_groups``
    values, extra state), which DCP's planners unpickle in full, are read only if a weights-only load of them
    succeeds."""
    planner = _checked_class(base)(**kwargs)
    planner.checked_source, planner.trust_pickle, planner.opt_in = str(source), trust_pickle, opt_in
    return planner


class _CheckedBytes:
    checked_source: str
    trust_pickle: bool
    opt_in: str

    def load_bytes(self, read_item: Any, value: IO[bytes]) -> None:
        if not self.trust_pickle:
            # Refuses what could run code; what passes names only allowed types, so the planner's own full unpickle
            # of the same bytes (which also puts the value in place) builds just those.
            with checked_unpickling(self.checked_source, opt_in=self.opt_in, item=read_item.dest_index.fqn):
                torch.load(value, weights_only=True)
            value.seek(0)
        super().load_bytes(read_item, value)  # type: ignore[misc]


@functools.cache
def _checked_class(base: type) -> type:
    return type(f"Checked{base.__name__}", (_CheckedBytes, base), {})
