"""ScalingMonitor on a pipeline of known stage times: the bubble it measures is the schedule's idle time, the
timeline is drawn.

No clock decides pass or fail: the stages' recorded actions are checked for the schedule's order, that order's
idle share is counted by replaying it with the stages' nominal times (forward 1, backward 2) and compared with the
theory exactly, and the monitor's measured bubble must be the time its step spent outside those same actions.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from lightning_parallel.plan.cost import bubble_fraction
from tests.bubble_worker import BACKWARD_S, FORWARD_S, MICROBATCHES, SCHEDULES
from tests.harness import launch_module

pytestmark = pytest.mark.distributed

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PP = 2


@pytest.fixture(scope="module")
def sleepy_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("bubble")
    proc = launch_module(["tests.bubble_worker", str(out)], timeout=300, nproc=2)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out


def schedule_order(schedule: str, stage: int, pp: int = PP, microbatches: int = MICROBATCHES) -> list[tuple[str, int]]:
    """The actions a stage runs, in order: GPipe all forwards then all backwards; 1F1B ``pp - stage`` forwards to
    warm up, then one backward and one forward in turn, then the remaining backwards."""
    forwards = [("F", k) for k in range(microbatches)]
    backwards = [("B", k) for k in range(microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(pp - stage, microbatches)
    order = forwards[:warmup]
    for k in range(microbatches - warmup):
        order += [backwards[k], forwards[warmup + k]]
    return order + backwards[microbatches - warmup:]


def replay(orders: dict[int, list[tuple[str, int]]], durations: dict[str, Fraction]) -> tuple[Fraction, Fraction]:
    """Run the stages' orders with fixed action times, each action starting once its stage is free and its input is
    there (a forward needs the previous stage's, a backward the next stage's); (span, idle) of the first stage."""
    last = max(orders)
    ends: dict[tuple[int, str, int], Fraction] = {}
    free = {stage: Fraction(0) for stage in orders}
    position = dict.fromkeys(orders, 0)
    while any(position[s] < len(orders[s]) for s in orders):
        moved = False
        for stage, order in orders.items():
            if position[stage] == len(order):
                continue
            kind, k = order[position[stage]]
            needs = (stage - 1, "F", k) if kind == "F" and stage > 0 else (stage + 1, "B", k) if kind == "B" and stage < last else None
            if needs is not None and needs not in ends:
                continue
            start = max(free[stage], ends[needs]) if needs else free[stage]
            ends[(stage, kind, k)] = free[stage] = start + durations[kind]
            position[stage] += 1
            moved = True
        assert moved, f"the recorded orders wait on each other forever: {orders}"
    span = max(free.values())
    return span, span - sum(durations[kind] for kind, _ in orders[0])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_measured_bubble_is_the_schedules_idle_time(schedule, sleepy_runs):
    summary = json.loads((sleepy_runs / f"{schedule}.json").read_text())
    events = json.loads((sleepy_runs / f"{schedule}_events.json").read_text())
    expected = bubble_fraction(schedule, pp=PP, microbatches=MICROBATCHES)
    assert expected == pytest.approx(1 / 5)
    # 1. Each stage ran the schedule's actions in the schedule's order (the measured step's, as the timeline shows).
    orders: dict[int, list[tuple[str, int]]] = {}
    for rank_events in events:
        for event in sorted(rank_events, key=lambda e: e["start"]):
            orders.setdefault(event["stage"], []).append((event["kind"], event["microbatch"]))
    assert sorted(orders) == list(range(PP))
    for stage, order in orders.items():
        assert order == schedule_order(schedule, stage), f"stage {stage} ran {order}"
    # 2. That order leaves the first stage idle for the theory's share of the step: counted, not timed.
    durations = {"F": Fraction(str(FORWARD_S)), "B": Fraction(str(BACKWARD_S))}
    span, idle = replay(orders, durations)
    assert idle / span == Fraction(PP - 1, MICROBATCHES + PP - 1) == Fraction(expected).limit_denominator(1000)
    # 3. The monitor's bubble on the first stage is its schedule step's time outside those recorded actions (its one
    # measured step is the recorded one): what it reports is that idle time, measured.
    first = summary["measured_by_rank"][0]
    assert first["steps"] == 1
    busy = sum(e["end"] - e["start"] for e in events[0])
    assert first["bubble_s"] == pytest.approx(first["pipeline_span_s"] - busy, rel=1e-9, abs=1e-9)
    assert first["bubble_s"] > 0 and first["bubble_fraction"] == pytest.approx(first["bubble_s"] / first["pipeline_span_s"])
    # The step splits into compute and waits, nothing left over.
    parts = summary["measured"]
    assert parts["compute_s"] + parts["bubble_s"] + parts["dp_s"] + parts["tp_s"] == pytest.approx(parts["step_s"], rel=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_timeline_is_drawn(schedule, sleepy_runs):
    picture = sleepy_runs / schedule / "pipeline_timeline.png"
    data = picture.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
