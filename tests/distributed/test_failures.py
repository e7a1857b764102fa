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


def test_a_rank_that_stalls_becomes_an_error_naming_it(tmp_path):
    """Rank 1 sleeps in training_step past the 10 s timeout; rank 0 waits in the gradient all-reduce."""
    spec = JobSpec(strategy="data", devices=2, steps=5, stall_rank=1, stall_step=2, stall_seconds=60, strategy_kwargs={"timeout": 10})
    start = time.monotonic()
    proc = launch_worker(spec, tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    report = proc.stdout + proc.stderr
    assert "lightning_parallel: a collective timed out" in report
    # Rank 0 waits in the synced log of training_step (its first collective there); rank 1 never got there.
    assert "rank 0: step 2, training_step, in its collective #1 (reduce) · rank 1: step 2, training_step —" in report
    assert "never reached the collective the others wait in: [1]" in report
    assert elapsed < 50, f"took {elapsed:.0f}s: the timeout is 10 s"
    time.sleep(1)
    assert processes_mentioning(str(tmp_path / "spec.json")) == [], "a rank outlived the job"
