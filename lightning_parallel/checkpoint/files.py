"""Where checkpoints live on disk, and how they appear there atomically.

A checkpoint is either one ``torch.save`` file (``full`` format) or a directory written by
``torch.distributed.checkpoint`` plus ``meta.pt`` (``sharded`` format, the layout Lightning's
``ModelParallelStrategy`` uses). Either is first written under a hidden partial name beside its final name
and renamed into place only when complete, so a crash or a kill mid-save leaves the previous checkpoint
intact and the partial one ignored (and swept away by the next save of the same name).
"""

from __future__ import annotations

import os
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Literal

import torch

# Lightning's name for the non-tensor part of a sharded checkpoint (loops, callbacks, hyperparameters).
META_FILENAME = "meta.pt"
# What DCP's coordinator writes last: a directory without it was never finished.
DCP_METADATA_FILENAME = ".metadata"
#: What lightning_parallel adds to every checkpoint: format, layout that wrote it, versions, RNG states.
INFO_KEY = "lightning_parallel"
PARTIAL_SUFFIX = ".partial"
_REPLACED_SUFFIX = ".replaced"

CheckpointFormat = Literal["sharded", "full"]


def package_version() -> str:
    """The installed lightning_parallel's version (recorded in every checkpoint), ``"unknown"`` if not installed.

    Read from the package metadata rather than ``lightning_parallel.__version__``: importing the package
    from here would import everything above this module (strategies included) and close an import cycle.
    """
    try:
        return version("lightning_parallel")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def partial_path(path: str | os.PathLike) -> Path:
    """The hidden name ``path`` is written under until complete (``dir/.name.partial``)."""
    path = Path(path)
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


def is_partial(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an unfinished write (never a checkpoint to load)."""
    name = Path(path).name
    return name.startswith(".") and name.endswith((PARTIAL_SUFFIX, _REPLACED_SUFFIX))


def checkpoint_format(path: str | os.PathLike) -> CheckpointFormat:
    """``sharded`` for a complete DCP directory, ``full`` for a file.

    Raises:
        FileNotFoundError: Nothing at ``path``.
        RuntimeError: A directory that is not a complete sharded checkpoint.
    """
    path = Path(path)
    if path.is_file():
        return "full"
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {str(path)!r}.")
    missing = [name for name in (DCP_METADATA_FILENAME, META_FILENAME) if not (path / name).is_file()]
    if missing:
        raise RuntimeError(
            f"{str(path)!r} is a directory but not a complete sharded checkpoint (it lacks {', '.join(missing)}): "
            "it was not written by lightning_parallel, or its save did not finish. Pass another checkpoint."
        )
    return "sharded"


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a finished checkpoint of either format."""
    if is_partial(path):
        return False
    try:
        checkpoint_format(path)
    except (FileNotFoundError, RuntimeError):
        return False
    return True


def latest_checkpoint(directory: str | os.PathLike, pattern: str = "*.ckpt") -> Path | None:
    """The most recently completed checkpoint in ``directory`` (partial writes ignored), or ``None``."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    complete = [path for path in directory.glob(pattern) if is_complete(path)]
    complete += _stranded_by_replacement(directory, pattern)
    return max(complete, key=_completed_at, default=None)


def _stranded_by_replacement(directory: Path, pattern: str) -> list[Path]:
    """Complete checkpoints left under their moved-aside name by a kill between the two renames of
    :func:`publish` (the final name is missing then): still good, so still candidates."""
    stranded = []
    for aside in directory.glob(f".{pattern}{_REPLACED_SUFFIX}"):
        final = aside.with_name(aside.name[1 : -len(_REPLACED_SUFFIX)])
        if not final.exists() and _has_checkpoint_files(aside):
            stranded.append(aside)
    return stranded


def _has_checkpoint_files(path: Path) -> bool:
    return path.is_file() or all((path / name).is_file() for name in (DCP_METADATA_FILENAME, META_FILENAME))


def _completed_at(path: Path) -> float:
    # A sharded checkpoint is complete when its meta file is: that file is written last.
    return (path / META_FILENAME).stat().st_mtime if path.is_dir() else path.stat().st_mtime


def prepare_partial(final: str | os.PathLike) -> Path:
    """Create an empty partial location for ``final`` (a leftover from a killed save is removed first)."""
    partial = partial_path(final)
    remove_path(partial)
    partial.parent.mkdir(parents=True, exist_ok=True)
    return partial


def publish(partial: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move a completed partial write to its final name.

    A file replaces a previous file in one atomic rename. A directory cannot be renamed over another (nor
    a file over a directory, or back), so the previous one is first moved aside under a hidden name and deleted only after the new one is in
    place: at every instant a complete checkpoint exists under the final name or under that hidden name
    (which :func:`latest_checkpoint` still finds if a kill strands it there).
    """
    partial, final = Path(partial), Path(final)
    _sync_directory_entries(partial)
    aside = final.with_name(f".{final.name}{_REPLACED_SUFFIX}")
    if final.exists() and (final.is_dir() or partial.is_dir()):
        remove_path(aside)
        os.replace(final, aside)
        os.replace(partial, final)
    else:
        os.replace(partial, final)
    remove_path(aside)  # the previous checkpoint, or one a kill stranded between the two renames
    _fsync(final.parent)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` that never leaves a truncated file under ``path``."""
    partial = prepare_partial(path)
    with open(partial, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    publish(partial, path)


def remove_path(path: str | os.PathLike) -> None:
    """Delete a checkpoint file or directory if it exists."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _sync_directory_entries(path: Path) -> None:
    """Flush what was written under ``path`` to disk before it is renamed into place."""
    if path.is_dir():
        for child in path.iterdir():
            if child.is_file():
                _fsync(child)
        _fsync(path)
    else:
        _fsync(path)


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
