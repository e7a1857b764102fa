"""Launches shared across test modules.

Starting processes is the slow part of a small job on 2 cores (each rank imports torch, Lightning and transformers:
about a minute for 8 ranks), so the job lists of several modules that use the same number of ranks run in one
launch: each module lists its jobs (``four_rank_specs``, ``eight_rank_specs``), and the first test that asks for
them starts the launch for all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harness import JobSpec, run_distributed_jobs

#: (results by job name, specs by job name, the launch's directory: each job's files under ``<root>/<name>/``).
Launch = tuple[dict[str, dict[str, Any]], dict[str, JobSpec], Path]


def shared_specs(ranks: int) -> dict[str, JobSpec]:
    """Every module's jobs of ``ranks`` ranks, by name (names are unique across modules)."""
    from tests.distributed import test_hot_path, test_hybrid_parallel, test_lightning_callbacks, test_lora, test_transformers

    specs: dict[str, JobSpec] = {}
    for module in (test_hybrid_parallel, test_transformers, test_hot_path, test_lightning_callbacks, test_lora):
        name = {4: "four_rank_specs", 8: "eight_rank_specs"}[ranks]
        if not hasattr(module, name):
            continue
        jobs = getattr(module, name)()
        clash = set(jobs) & set(specs)
        assert not clash, f"{ranks}-rank job names used twice: {sorted(clash)}"
        specs.update(jobs)
    return specs


def _launch(ranks: int, tmp_path_factory) -> Launch:
    specs = shared_specs(ranks)
    root = tmp_path_factory.mktemp(f"{ranks}_ranks")
    return run_distributed_jobs(specs, root, timeout=2700), specs, root


@pytest.fixture(scope="session")
def four_rank_launch(tmp_path_factory) -> Launch:
    """Every 4-rank job of the shared modules, in one launch."""
    return _launch(4, tmp_path_factory)


@pytest.fixture(scope="session")
def eight_rank_launch(tmp_path_factory) -> Launch:
    """Every 8-rank job of the shared modules, in one launch."""
    return _launch(8, tmp_path_factory)
