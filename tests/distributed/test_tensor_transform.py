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
    result = torch.load(out)
    for reference_loss, tp_loss in result["losses"]:
        assert tp_loss == pytest.approx(reference_loss, abs=1e-10)
    assert result["grad_gap"] < 1e-10
    assert result["param_gap"] < 1e-10
    # Each rank holds half of the split MLP (biases of the row-wise layer stay whole).
    assert result["local_mlp"] < 0.51 * result["full_mlp"]
    assert result["n_head"] == 2
