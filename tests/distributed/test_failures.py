"""A failing rank must take the whole job down, quickly and with its error visible: never a hang."""

from __future__ import annotations

import time

import pytest

from tests.harness import JobSpec, launch_worker, processes_mentioning

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("fail_rank", [1, 0], ids=["worker-rank-fails", "launching-rank-fails"])
def test_a_rank_that_raises_mid_step_ends_every_rank(fail_rank, tmp_path):
    spec = JobSpec(strategy="data", devices=2, steps=5, fail_rank=fail_rank, fail_step=2, strategy_kwargs={"timeout": 30})
    start = time.monotonic()
    proc = launch_worker(spec, tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert f"rank {fail_rank} fails on purpose at batch 2" in proc.stderr
    # Well inside the 30 s collective timeout plus start-up: the survivors do not wait it out.
    assert elapsed < 60, f"took {elapsed:.0f}s"
    time.sleep(1)
    assert processes_mentioning(str(tmp_path / "spec.json")) == [], "a rank outlived the job"
