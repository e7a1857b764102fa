"""Choosing the ranks of a dry run, and judging its figures against the planner's."""

from __future__ import annotations

import pytest

from lightning_parallel.layout import ParallelLayout
from lightning_parallel.plan.simulate import chosen_ranks, disagreements


def layout(dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> ParallelLayout:
    return ParallelLayout(data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=pp, context_parallel_size=cp)


def test_auto_takes_the_first_and_last_rank_and_the_middle_of_every_axis():
    grid = layout(pp=8, dp=64, cp=2, tp=4)  # 4,096 ranks
    ranks = chosen_ranks(grid)
    assert ranks[0] == 0 and ranks[-1] == 4095
    middles = {axis: [r for r in ranks if grid.axis_coordinates(r)[axis] == grid.size(axis) // 2] for axis in ("pp", "dp_replicate", "cp", "tp")}
    assert all(middles.values()), middles
    assert len(ranks) == 6


def test_given_ranks_are_checked_against_the_layout():
    grid = layout(pp=2, dp=4)
    assert chosen_ranks(grid, "7,0,3,3") == [0, 3, 7]
    with pytest.raises(ValueError, match="ranks must lie in 0..7"):
        chosen_ranks(grid, "0,8")
    with pytest.raises(ValueError, match="comma-separated ranks"):
        chosen_ranks(grid, "first")


def test_a_figure_off_by_more_than_ten_percent_disagrees():
    pairs = {"parameters": (100.0, 100.0), "tp comm": (73.0, 100.0), "pp comm": (0.0, 0.0), "dp comm": (5.0, 0.0)}
    assert disagreements(pairs) == ["tp comm", "dp comm"]
