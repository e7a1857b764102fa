"""What a sweep's cells were measured at: the library's content hash and the git commit (issue 55 item 1).

Partial re-sweeps keep older cells, so every cell records its own :func:`fingerprint`; :func:`summarise` gives
the line at the top of ``results.json`` (and under the README's counts): which commits the cells come from, and
how many from each. The hash is over the sources of the ``lightning_parallel`` actually imported (so a sweep
run from a snapshot clone hashes the clone's package), not over the checkout's working tree.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

#: Cells written before cells recorded what they ran at (the results of b30e40b and earlier re-sweeps).
UNRECORDED = "unrecorded"


def library_hash(package: Path | None = None) -> str:
    """sha256 over every ``*.py`` of the package, by sorted relative path, each path and its bytes hashed."""
    if package is None:
        import lightning_parallel

        package = Path(lightning_parallel.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py"), key=lambda p: p.relative_to(package).as_posix()):
        if "__pycache__" in path.parts:
            continue
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def git_commit(where: Path) -> str:
    """The short commit checked out at ``where``, with ``+dirty`` when the library's sources differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short=10", "HEAD")
        dirty = git("status", "--porcelain", "--", "lightning_parallel")
    except (OSError, subprocess.CalledProcessError):
        return UNRECORDED
    return commit + ("+dirty" if dirty else "")


@lru_cache(maxsize=1)
def fingerprint() -> dict[str, str]:
    """``{"commit", "library_sha256"}`` of the imported library (computed once per process)."""
    import lightning_parallel

    package = Path(lightning_parallel.__file__).resolve().parent
    return {"commit": git_commit(package.parent), "library_sha256": library_hash(package)}


def summarise(families: dict[str, Any]) -> dict[str, Any]:
    """The top-of-file summary: for each (commit, library hash) the cells measured there, newest sweep's count first."""
    seen: Counter[tuple[str, str]] = Counter()
    for record in families.values():
        for cell in record.get("cells", {}).values():
            seen[cell.get("commit", UNRECORDED), cell.get("library_sha256", UNRECORDED)] += 1
    return {"cells_by_commit": [{"commit": commit, "library_sha256": sha, "cells": count}
                                for (commit, sha), count in seen.most_common()]}


def describe(summary: dict[str, Any]) -> str:
    """``at commit abc (library sha256 0123…)`` or, for a mixed file, each commit with its number of cells."""
    rows = summary.get("cells_by_commit", [])
    if not rows:
        return "at an unrecorded commit"
    if len(rows) == 1 and rows[0]["commit"] == UNRECORDED:
        return "at an unrecorded commit (swept before cells recorded theirs)"
    if len(rows) == 1:
        return f"at commit `{rows[0]['commit']}` (library sha256 `{rows[0]['library_sha256'][:12]}`)"
    parts = [f"`{row['commit']}` ({row['cells']} cells)" if row["commit"] != UNRECORDED
             else f"an unrecorded one ({row['cells']} cells, swept before cells recorded their commit)" for row in rows]
    return "at commits " + ", ".join(parts)
