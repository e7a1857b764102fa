"""A failing rank must take the whole job down, with its error visible: never a hang.

No clock decides these tests: a job that does not end by itself is killed by the launch's budget (``LAUNCH_BUDGET``,
far above a slow start-up) and fails as a hang. Where the job must not wait for a timeout, the collective timeout is
set beyond that budget, so waiting for it can only end as that failure; where the timeout must turn a hang into an
error, the stalled rank waits for an event that never comes (it cannot end the job by waking up).
"""

from __future__ import annotations

import time

import pytest

from tests.harness import JobSpec, launch_worker, processes_mentioning

pytestmark = pytest.mark.distributed

#: Seconds a launch may take before the harness kills it and the test fails (start-up on 2 loaded cores is ~30 s).
LAUNCH_BUDGET = 300


def assert_no_rank_outlived_the_job(tmp_path) -> None:
    """Every rank of the job is gone (after the launcher's exit the others may take a moment to be reaped: wait for
    that, within a budget, rather than a fixed sleep)."""
    marker = str(tmp_path / "spec.json")
    deadline = time.monotonic() + 60
    while processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(marker) == [], "a rank outlived the job"


@pytest.mark.parametrize("fail_rank", [1, 0], ids=["worker-rank-fails", "launching-rank-fails"])
def test_a_rank_that_raises_mid_step_ends_every_rank(fail_rank, tmp_path):
    # The survivors wait in a collective for the failed rank: the collective timeout (2 × the launch budget) is not
    # what may end them, the failure must.
    spec = JobSpec(strategy="data", devices=2, steps=5, fail_rank=fail_rank, fail_step=2, strategy_kwargs={"timeout": 2 * LAUNCH_BUDGET})
    proc = launch_worker(spec, tmp_path, timeout=LAUNCH_BUDGET)
    assert proc.returncode != 0
    assert f"rank {fail_rank} fails on purpose at batch 2" in proc.stderr
    assert "a collective timed out" not in proc.stdout + proc.stderr
    assert_no_rank_outlived_the_job(tmp_path)


def test_a_rank_that_stalls_becomes_an_error_naming_it(tmp_path):
    """Rank 1 waits in training_step for an event that never comes; rank 0 waits in its first collective there until
    the 10 s timeout, which must end the job (rank 1 too) with a report naming rank 1."""
    spec = JobSpec(strategy="data", devices=2, steps=5, stall_rank=1, stall_step=2, stall_seconds=-1, strategy_kwargs={"timeout": 10})
    proc = launch_worker(spec, tmp_path, timeout=LAUNCH_BUDGET)
    assert proc.returncode != 0
    report = proc.stdout + proc.stderr
    assert "lightning_parallel: a collective timed out" in report
    # Rank 0 waits in the synced log of training_step (its first collective there); rank 1 never got there.
    assert "rank 0: step 2, training_step, in its collective #1 (reduce) · rank 1: step 2, training_step —" in report
    assert "never reached the collective the others wait in: [1]" in report
    assert_no_rank_outlived_the_job(tmp_path)
