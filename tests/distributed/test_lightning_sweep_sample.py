"""A fixed sample of the sweep of Lightning's side (docs/lightning-callbacks.md), run for real through the sweep's own
runner (one 2-rank world) and compared with the committed statuses in ``tests/lightning_sweep/results.json``: a cell
that was ``same`` must still be, a ``refused`` one must still be refused with the same error type, and no cell may be
``wrong`` or ``crash``.

The sample covers what the library changes in Lightning's callbacks, one cell each (the suite's budget for it is 90 s):
BaseFinetuning's parameter comparison on DTensors (tp2), ThroughputMonitor's replica count (tp2), the LR finder's loss
over replicas (dp2), the whole model's summary counts under pipeline stages (pp2), a refusal (StochasticWeightAveraging
under tp2).
"""

import pytest

from tests.lightning_sweep.sweep import RESULTS, load, sweep

pytestmark = pytest.mark.distributed

SAMPLE = [
    ("backbone_finetuning", "tp2"),
    ("throughput_monitor", "tp2"),
    ("learning_rate_finder", "dp2"),
    ("model_summary", "pp2"),
    ("stochastic_weight_averaging", "tp2"),
]


def test_sample_matches_the_committed_sweep(tmp_path):
    committed = load(RESULTS)["cases"]
    cases = sorted({case for case, _ in SAMPLE}, key=[case for case, _ in SAMPLE].index)
    layouts = sorted({layout for _, layout in SAMPLE})
    results = sweep(cases, layouts, results_path=None, workdir=tmp_path, log=None, only=SAMPLE)["cases"]
    bad = []
    for case, layout in SAMPLE:
        cell, want = results[case]["cells"][layout], committed[case]["cells"][layout]
        if cell["status"] in ("wrong", "crash") or cell["status"] != want["status"] or cell.get("error") != want.get("error"):
            detail = cell.get("first_difference") or f"{cell.get('error')}: {cell.get('message')} at {cell.get('where')}"
            bad.append(f"{case} {layout}: {cell['status']} (committed: {want['status']}): {detail}")
    assert not bad, "\n".join(bad)
