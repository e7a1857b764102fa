"""The tensor-parallel transform on its own: TP=2 over the inferred plan trains like one device (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed import tp_worker

pytestmark = pytest.mark.distributed


def test_inferred_plan_on_two_ranks_matches_single_device(tmp_path):
    out = tmp_path / "result.pt"
    mp.start_processes(tp_worker.run, args=(2, str(tmp_path / "store"), str(out), 4), nprocs=2, start_method="spawn")
    results = torch.load(out)
    for tied in (True, False):
        result = results[tied]
        for reference_loss, tp_loss in result["losses"]:
            assert tp_loss == pytest.approx(reference_loss, abs=1e-10)
        assert result["grad_gap"] < 1e-10
        assert result["param_gap"] < 1e-10
        # Each rank holds half of the split MLP (biases of the row-wise layer stay whole).
        assert result["local_mlp"] < 0.51 * result["full_mlp"]
        assert result["n_head"] == 2
        # The vocabulary-split table's gradient is its rows only, tied to the head or not (torch's own backward
        # computes the whole table's, and an untied table kept it whole).
        assert result["lookup_grads"] == {("(Shard(dim=0),)", (16, 16))}
    # The split lookup's backward: the padding row gets no gradient on whichever rank holds it.
    assert all(gap < 1e-12 for gap in results["lookup_gaps"].values())
