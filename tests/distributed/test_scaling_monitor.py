"""ScalingMonitor on a pipeline of known stage times: the measured bubble is the theory's, the timeline is drawn."""

from __future__ import annotations

import json

import pytest

from lightning_parallel.plan.cost import bubble_fraction
from tests.bubble_worker import MICROBATCHES, SCHEDULES
from tests.harness import launch_module

pytestmark = pytest.mark.distributed

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sleepy_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("bubble")
    proc = launch_module(["tests.bubble_worker", str(out)], timeout=300, nproc=2)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_measured_bubble_matches_theory(schedule, sleepy_runs):
    summary = json.loads((sleepy_runs / f"{schedule}.json").read_text())
    expected = bubble_fraction(schedule, pp=2, microbatches=MICROBATCHES)
    assert expected == pytest.approx(1 / 5)
    # Stage 0 starts the step and finishes it last: its idle share is the schedule's bubble.
    measured = summary["measured"]["bubble_fraction"]
    assert measured == pytest.approx(expected, rel=0.10), summary["measured"]
    # The step splits into compute and waits, nothing left over.
    parts = summary["measured"]
    assert parts["compute_s"] + parts["bubble_s"] + parts["dp_s"] + parts["tp_s"] == pytest.approx(parts["step_s"], rel=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_timeline_is_drawn(schedule, sleepy_runs):
    picture = sleepy_runs / schedule / "pipeline_timeline.png"
    data = picture.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
