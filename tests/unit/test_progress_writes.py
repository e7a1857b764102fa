"""A rank's progress (for the hang report) reaches the store at most once per interval, the latest value first."""

from __future__ import annotations

import time

from lightning_parallel.strategies.components.progress import _LatestValueWriter


class CountingStore:
    def __init__(self) -> None:
        self.values: list[str] = []

    def set(self, key: str, value: str) -> None:
        self.values.append(value)


def test_many_phases_in_a_second_make_one_or_two_writes_and_the_last_one_is_kept():
    store = CountingStore()
    writer = _LatestValueWriter(store, "progress/0", interval=5.0)
    try:
        for step in range(300):  # 100 optimizer steps of 3 phases each, faster than the interval
            writer.put(f"{step}:training_step:0:")
        deadline = time.monotonic() + 10
        while not store.values and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 1 <= len(store.values) <= 2
        writer.flush()  # what a rank whose collective timed out does before reading everyone's
        assert store.values[-1] == "299:training_step:0:"
        writes = len(store.values)
        writer.flush()
        assert len(store.values) == writes  # an unchanged value is not written again
    finally:
        writer.close()


def test_a_rank_that_stops_moving_is_reported_once_before_the_timeout_and_again_after_it_moves():
    # Under NCCL a timed-out collective ends the process without a Python error: the writer's thread reports first.
    stalls: list[float] = []
    writer = _LatestValueWriter(CountingStore(), "progress/0", interval=0.05, stall_after=0.2, on_stall=stalls.append)
    try:
        writer.put("3:backward:0:")
        deadline = time.monotonic() + 10
        while not stalls and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        assert len(stalls) == 1 and stalls[0] > 0.2
        writer.touch()  # a validation step: progress, so the clock starts again
        deadline = time.monotonic() + 10
        while len(stalls) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(stalls) == 2
    finally:
        writer.close()
