"""Measurements of a machine, cached as JSON files: measured once by one process while the others wait.

The ranks of a job start together; measuring in several at once would measure their contention, so one process
holds a file lock while it measures and writes, and the others read what it wrote. Files are written whole and
renamed (a reader never sees half a file); a file written by another version of the record's dataclass reads as
absent, and is measured again.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

#: Set to ``1`` to measure again even where a cache exists.
REMEASURE_ENV = "LIGHTNING_PARALLEL_MEASURE_HARDWARE"

Record = TypeVar("Record")


def read(path: Path, kind: Callable[..., Record]) -> Record | None:
    """The record of type ``kind`` in ``path``; ``None`` if absent or written by another version of ``kind``."""
    if not path.is_file():
        return None
    try:
        return kind(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None


def write(path: Path, record: object) -> None:
    """Write the dataclass ``record`` to ``path`` whole, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        handle.write(json.dumps(asdict(record), indent=2))
    os.replace(handle.name, path)


def cached(path: Path, kind: Callable[..., Record], measure: Callable[[], Record], what: str,
           remeasure: bool | None = None) -> Record:
    """The record in ``path``, or ``measure()``'s, written there under a lock (see the module doc).

    Args:
        what: Said on stderr before measuring (what is measured, how long it takes).
        remeasure: Measure even if cached (default: whether :data:`REMEASURE_ENV` is ``1``).
    """
    if remeasure is None:
        remeasure = os.environ.get(REMEASURE_ENV, "") == "1"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = None if remeasure else read(path, kind)
        if found is not None:
            return found
        print(f"lightning_parallel: measuring {what} once (cached in {path})", file=sys.stderr, flush=True)
        measured = measure()
        write(path, measured)
    return measured
