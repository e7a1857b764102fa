"""The committed coverage sweep results are well-formed, and the blocks they render are what README.md (the counts)
and docs/coverage.md (every family) hold."""

import json

import pytest

pytest.importorskip("transformers")

from tests.coverage.cells import LAYOUTS, MAX_TOLERANCE  # noqa: E402
from tests.coverage.configs import TASKS  # noqa: E402
from tests.coverage.provenance import UNRECORDED, summarise  # noqa: E402
from tests.coverage.report import (  # noqa: E402
    BEGIN,
    END,
    PAGE,
    PAGE_BEGIN,
    PAGE_END,
    README,
    block,
    render,
    summary,
)
from tests.coverage.sweep import RESULTS  # noqa: E402

STATUSES = {"exact", "refused", "wrong", "crash"}


def results() -> dict:
    return json.loads(RESULTS.read_text())


def test_every_record_is_well_formed():
    data = results()
    assert set(data["versions"]) == {"transformers", "torch"}
    assert data["families"], "no families swept"
    # What the cells were measured at, summarised first in the file (tests/coverage/provenance.py).
    assert data["swept_at"] == summarise(data["families"]), "results.json's swept_at is stale: save it with tests.coverage.sweep.save"
    for row in data["swept_at"]["cells_by_commit"]:
        assert row["commit"] == UNRECORDED or (len(row["library_sha256"]) == 64 and row["commit"]), row
    for name, record in data["families"].items():
        assert name == f"{record['task']}/{record['model_type']}", name
        assert record["task"] in TASKS, name
        assert record["model_class"], name
        assert isinstance(record["reference_seconds"], (int, float)), name
        if not record["built"]:
            assert record["reason"].strip(), f"{name}: not built without a reason"
            assert not record.get("cells"), f"{name}: cells for a family that was not built"
            continue
        assert set(record["cells"]) <= set(LAYOUTS), name
        for layout, cell in record["cells"].items():
            status = cell["status"]
            assert status in STATUSES or (layout.startswith("tp") and status.startswith("exact (share ")), (name, layout, status)
            assert cell["seconds"] is None or cell["seconds"] >= 0, (name, layout)
            if status in ("refused", "crash"):
                assert cell["error"] and "message" in cell, (name, layout)
            if status == "wrong":
                assert cell["max_rel_diff"] > 0 and cell["first_difference"], (name, layout)
            if status.startswith("exact"):
                # Within 1e-6, or within the family's recorded tolerance (float32 inside: see cells.FLOOR_MARGIN).
                assert cell["max_abs_diff"] <= cell.get("tolerance", 1e-6), (name, layout)
                assert cell.get("tolerance", 1e-6) <= MAX_TOLERANCE, (name, layout)
            if layout.startswith("tp") and status.startswith("exact"):
                assert (cell["share"] <= 0.6) == (status == "exact"), (name, layout)


def test_readme_block_matches_the_committed_results():
    text = README.read_text()
    assert BEGIN in text and END in text, "README.md lacks the coverage markers"
    stale = "README is stale: run `python -m tests.coverage --report --readme`"
    assert block(text, BEGIN, END) == summary(results()), stale


def test_coverage_page_block_matches_the_committed_results():
    text = PAGE.read_text()
    assert PAGE_BEGIN in text and PAGE_END in text, "docs/coverage.md lacks the coverage markers"
    assert block(text, PAGE_BEGIN, PAGE_END) == render(results()), (
        "docs/coverage.md is stale: run `python -m tests.coverage --report --readme`"
    )


def test_readme_shows_the_counts_and_not_every_family():
    """The family table (hundreds of rows) lives in docs/coverage.md; the README keeps the counts."""
    readme = block(README.read_text(), BEGIN, END)
    assert "| family | task |" not in readme
    assert any(f"`{record['model_class']}`" in PAGE.read_text() for record in results()["families"].values())


def _run(grad: float, buffer: float, divergent: tuple[str, ...] = ()) -> dict:
    """A one-step finding: one parameter's gradient and one buffer's value."""
    import torch

    return {
        "step_losses": torch.tensor([1.0]), "grads": [{"w": torch.tensor([grad])}],
        "states": [{"w": torch.tensor([0.0]), "stat": torch.tensor([buffer])}], "validation": {},
        "local_bytes": 8, "divergent_buffers": list(divergent),
    }


def test_judge_allows_a_float32_floor_but_not_a_bug():
    from tests.coverage.cells import MAX_TOLERANCE, TOL, judge, tolerance

    float64 = {**_run(1.0, 0.0), "floor": 1e-13}
    float32 = {**_run(1.0, 0.0), "floor": 5e-9}
    assert tolerance(float64) == TOL and tolerance(float32) == pytest.approx(5e-6)
    assert judge("dp2", float64, _run(1.0 + 3e-6, 0.0), 8)["status"] == "wrong"
    assert judge("dp2", float32, _run(1.0 + 3e-6, 0.0), 8)["status"] == "exact"
    assert tolerance({**float32, "floor": 1.0}) == MAX_TOLERANCE  # a floor that large would hide a bug: capped
    assert judge("dp2", {**float32, "floor": 1.0}, _run(1.1, 0.0), 8)["status"] == "wrong"


def test_judge_skips_only_the_buffers_the_strategy_warned_about():
    from tests.coverage.cells import judge

    expected = {**_run(1.0, 0.0), "floor": 0.0}
    assert judge("dp2", expected, _run(1.0, 0.5), 8)["status"] == "wrong"  # a silent difference in a buffer
    warned = judge("dp2", expected, _run(1.0, 0.5, divergent=("stat",)), 8)
    assert warned["status"] == "exact" and warned["divergent_buffers_warned"] == ["stat"]
    assert judge("dp2", expected, _run(1.5, 0.5, divergent=("stat",)), 8)["status"] == "wrong"  # parameters still count


def test_a_re_run_worse_than_the_committed_results_is_named():
    """The sample re-run's comparison (tests/distributed/test_coverage_sample.py) on edited copies of the committed
    results: a cell going from exact to refused, or a tp share crossing 0.6, is named with both values; improving is
    allowed; the unchanged results give nothing."""
    import copy

    from tests.coverage.staleness import regressions

    committed = results()
    name = next(n for n, r in committed["families"].items() if r["built"] and r["cells"].get("tp2", {}).get("status") == "exact")
    assert regressions(committed, committed) == []

    refused = copy.deepcopy(committed)
    refused["families"][name]["cells"]["dp2"] = {"status": "refused", "error": "ValueError", "message": "dp2 not supported"}
    found = regressions(committed, refused, [name])
    assert len(found) == 1 and found[0].startswith(f"{name} dp2: committed exact") and "now refused: ValueError" in found[0]

    shared = copy.deepcopy(committed)
    shared["families"][name]["cells"]["tp2"].update(status="exact (share 0.71)", share=0.71)
    before = committed["families"][name]["cells"]["tp2"]["share"]
    assert regressions(committed, shared, [name]) == [f"{name} tp2: committed exact (share {before}); now exact (share 0.71)"]

    # Improving is allowed: the committed copy says refused, the re-run exact.
    older = copy.deepcopy(committed)
    older["families"][name]["cells"]["tp2"] = {"status": "refused", "error": "ValueError", "message": "no plan"}
    assert regressions(older, committed, [name]) == []
    # ... but not the reverse, nor a family that stops building or loses a cell.
    assert regressions(committed, older, [name]) != []
    unbuilt = copy.deepcopy(committed)
    unbuilt["families"][name] = {**unbuilt["families"][name], "built": False, "reason": "config error", "cells": {}}
    assert regressions(committed, unbuilt, [name]) == [f"{name}: committed built, now not built: config error"]
    dropped = copy.deepcopy(committed)
    del dropped["families"][name]["cells"]["dp2"]
    assert regressions(committed, dropped, [name]) == [f"{name} dp2: committed exact; not run now"]
