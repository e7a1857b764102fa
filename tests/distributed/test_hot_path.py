"""The training step's host syncs and library collectives per optimizer step: constant in depth and micro-batches,
within the committed budget, under every layout (jobs in the suite's 4-rank launch; see :mod:`tests.hot_path`).

Gradient clipping, the non-finite guard and the ScalingMonitor are on, as a user's run has them. The committed table
(``benchmarks/results/hot_path.json``, written by ``benchmarks/hot_path.py``) is the budget: a change that adds a
host sync or a collective to some layout's step fails here until the table is rewritten (and the reason stated).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import hot_path

pytestmark = pytest.mark.distributed

BUDGET = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "hot_path.json").read_text())


def four_rank_specs():
    return hot_path.specs()


@pytest.fixture(scope="module")
def counts(four_rank_launch):
    results = four_rank_launch[0]
    return hot_path.table({name: results[name] for name in hot_path.specs()})


@pytest.mark.parametrize("layout", list(hot_path.LAYOUTS))
def test_the_step_costs_the_same_host_syncs_and_collectives_at_any_depth(layout, counts):
    row = counts[layout]
    shallow, deep = (row[f"{depth}_blocks"] for depth in hot_path.DEPTHS)
    # Only expert dispatch's read of its split sizes grows: once per MoE layer (one in every block) and forward.
    by_design = hot_path.PER_MOE_LAYER_SYNCS.get(layout, 0) * (hot_path.DEPTHS[1] - hot_path.DEPTHS[0]) * hot_path.ACCUMULATE
    assert deep["host_syncs"] - shallow["host_syncs"] == by_design, row
    assert shallow["library_collectives"] == deep["library_collectives"], row
    for more in (key for key in row if key.endswith("_microbatches")):
        assert row[more]["host_syncs"] == shallow["host_syncs"], row
        assert row[more]["library_collectives"] == shallow["library_collectives"], row


@pytest.mark.parametrize("layout", list(hot_path.LAYOUTS))
def test_the_step_stays_within_the_committed_budget(layout, counts):
    budget = BUDGET["layouts"][layout]
    for case, measured in counts[layout].items():
        for what in ("host_syncs", "library_collectives"):
            assert measured[what] <= budget[case][what], (
                f"{layout}, {case}: {measured[what]} {what} per optimizer step, the committed table says "
                f"{budget[case][what]}: remove the new one, or rerun benchmarks/hot_path.py and say why in the commit."
            )


def test_lightning_ddp_reference_makes_no_host_sync_of_its_own(counts):
    # The reference the budget is read against (Lightning's DDPStrategy, the same model, clipping and monitor).
    assert counts["lightning_ddp"]["2_blocks"]["library_collectives"] == 0
