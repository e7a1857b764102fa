"""lightning_parallel.strategies.lightning_callbacks without processes: BaseFinetuning's comparison, the replica-counting
throughput meter, and the refusals that name the fix (the layouts themselves: tests/distributed/test_lightning_sweep_sample.py)."""

from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BaseFinetuning,
    BatchSizeFinder,
    ModelPruning,
    StochasticWeightAveraging,
)

from lightning_parallel.strategies.lightning_callbacks import (
    ReplicaThroughput,
    check,
    filter_on_optimizer,
)


def test_filter_on_optimizer_is_lightnings_on_plain_tensors():
    held = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.arange(4.0))]
    equal_values = torch.nn.Parameter(torch.ones(3))  # another parameter, same values: Lightning skips it too
    new = [torch.nn.Parameter(torch.zeros(3)), equal_values, held[1], torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.SGD(held, lr=0.1)
    ours, lightnings = filter_on_optimizer(optimizer, new), BaseFinetuning.filter_on_optimizer(optimizer, new)
    assert [id(p) for p in ours] == [id(p) for p in lightnings] == [id(new[0]), id(new[3])]


def feed(meter: Throughput) -> dict:
    for step in range(1, 4):
        meter.update(time=float(step), batches=step, samples=4 * step, flops=100.0)
    return meter.compute()


def test_replica_throughput_counts_replicas_not_devices():
    # tp2 (one replica on two devices): one device's figures, no global ones, as on one device; FLOPs over both devices.
    one_device, tp2 = feed(Throughput(window_size=2)), feed(ReplicaThroughput(1, 2, window_size=2, available_flops=50.0))
    assert tp2["device/samples_per_sec"] == one_device["device/samples_per_sec"] == 4.0
    assert "samples_per_sec" not in tp2
    assert tp2["device/flops_per_sec"] == one_device["device/flops_per_sec"] / 2
    assert tp2["device/mfu"] == tp2["device/flops_per_sec"] / 50.0
    # dp2 x tp2: two replicas' samples; FLOPs of both batches over four devices.
    dp2_tp2 = feed(ReplicaThroughput(2, 4, window_size=2))
    assert dp2_tp2["samples_per_sec"] == 8.0 and dp2_tp2["batches_per_sec"] == 2.0
    assert dp2_tp2["flops_per_sec"] == 200.0 and dp2_tp2["device/flops_per_sec"] == 50.0


def engine(dtensors: bool = False, pipeline: bool = False, dp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(parameters_are_dtensors=dtensors, pipeline_parallel=SimpleNamespace(enabled=pipeline),
                           layout=SimpleNamespace(data_parallel_size=dp), world_size=max(dp, 2 if dtensors or pipeline else 1))


def test_batch_size_finder_is_refused_on_several_ranks_with_the_planner_named():
    with pytest.raises(ValueError, match="lightning_parallel.plan"):
        check(engine(dp=2), SimpleNamespace(callbacks=[BatchSizeFinder()]))
    check(engine(), SimpleNamespace(callbacks=[BatchSizeFinder()]))  # one rank: Lightning's own


@pytest.mark.parametrize(("callback", "fix"), [
    (StochasticWeightAveraging(swa_lrs=0.1), "WeightAveraging()"),
    (ModelPruning("l1_unstructured", amount=0.5), "prune.remove"),
])
@pytest.mark.parametrize("layout", [{"dtensors": True}, {"pipeline": True}])
def test_callbacks_that_cannot_see_a_split_model_are_refused_with_the_fix(callback, fix, layout):
    with pytest.raises(ValueError, match=type(callback).__name__) as error:
        check(engine(**layout), SimpleNamespace(callbacks=[callback]))
    assert fix in str(error.value)
    check(engine(), SimpleNamespace(callbacks=[callback]))  # one rank: Lightning's own


def test_ddp_replicas_run_swa_and_refuse_pruning():
    check(engine(dp=2), SimpleNamespace(callbacks=[StochasticWeightAveraging(swa_lrs=0.1)]))  # whole model on each rank
    with pytest.raises(ValueError, match="use_lottery_ticket_hypothesis=False"):
        check(engine(dp=2), SimpleNamespace(callbacks=[ModelPruning("l1_unstructured", amount=0.5)]))
    check(engine(dp=2), SimpleNamespace(callbacks=[ModelPruning("l1_unstructured", amount=0.5, use_lottery_ticket_hypothesis=False)]))


def test_finetuning_under_ddp_replicas_is_refused_and_allowed_elsewhere():
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    with pytest.raises(ValueError, match="data_parallel_mode='shard'"):
        check(engine(dp=2), SimpleNamespace(callbacks=[finetuning]))
    for layout in ({"dtensors": True, "dp": 2}, {"pipeline": True}, {"dp": 1}):
        check(engine(**layout), SimpleNamespace(callbacks=[finetuning]))
