"""Strategy construction and Trainer wiring, checked in-process (nothing is launched)."""

from datetime import timedelta

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_parallel
from lightning_parallel import (
    DataParallelStrategy,
    HybridParallelStrategy,
    ParallelEngineStrategy,
    ParallelLayout,
    TensorParallelStrategy,
)


def test_names_are_registered_with_descriptions():
    for name, start_method in (("data_parallel", "popen"), ("data_parallel_spawn", "spawn"), ("data_parallel_fork", "fork")):
        assert name in StrategyRegistry
        entry = StrategyRegistry[name]
        assert entry["strategy"] is DataParallelStrategy
        assert "data parallelism" in entry["description"]
        assert entry["init_params"] == {"start_method": start_method}


def test_trainer_accepts_registered_name():
    trainer = L.Trainer(strategy="data_parallel", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, DataParallelStrategy)
    assert trainer.strategy.layout == ParallelLayout(2, 1, 1)
    assert trainer.strategy.is_distributed


def test_sampler_uses_data_parallel_rank_and_size():
    trainer = L.Trainer(strategy=DataParallelStrategy(), accelerator="cpu", devices=4, logger=False)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 0}


def test_devices_fewer_than_layout_fails_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"at least data_parallel_size=4 = 4 ranks, but the world size is 2 \(trainer devices=2 × num_nodes=1\)"):
        L.Trainer(strategy=DataParallelStrategy(data_parallel_size=4), accelerator="cpu", devices=2, logger=False)


def test_layout_product_not_world_size_fails_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"data_parallel_size=2 = 2 ranks does not match the world size 4"):
        L.Trainer(strategy=DataParallelStrategy(data_parallel_size=2), accelerator="cpu", devices=4, logger=False)


def test_unknown_comm_hook_fails_at_construction():
    with pytest.raises(ValueError, match="comm_hook='fp8' is unknown"):
        DataParallelStrategy(comm_hook="fp8")


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"start_method": "thread"}, ValueError, "start_method='thread' is unknown"),
        ({"timeout": 0}, ValueError, "timeout=0.0s must be positive"),
        ({"timeout": "30"}, TypeError, "timeout must be seconds"),
    ],
)
def test_bad_launch_options(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        DataParallelStrategy(**kwargs)


def test_timeout_accepts_seconds_and_timedelta():
    assert DataParallelStrategy(timeout=12)._timeout == timedelta(seconds=12)
    assert DataParallelStrategy(timeout=timedelta(minutes=1))._timeout == timedelta(seconds=60)


def test_engine_rejects_combinations_it_cannot_apply_yet():
    with pytest.raises(TypeError, match="layout must be a ParallelLayout"):
        ParallelEngineStrategy(layout={"data_parallel_size": 2})


def trainer_with(strategy, devices, **kwargs):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, **kwargs)


def test_hybrid_strategy_wiring_and_errors():
    trainer = trainer_with(HybridParallelStrategy(2, 2, 2), 8)
    assert trainer.strategy.layout == ParallelLayout(2, 2, 2)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert isinstance(trainer_with("hybrid_parallel", 2).strategy, HybridParallelStrategy)
    # -1 fills the rest.
    assert trainer_with(HybridParallelStrategy(-1, 2, 2), 8).strategy.layout == ParallelLayout(2, 2, 2)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 × data_parallel_size=2 × tensor_parallel_size=2 = 8 ranks, but the world size is 4"):
        trainer_with(HybridParallelStrategy(2, 2, 2), 4)
    with pytest.raises(ValueError, match=r"= 4 ranks does not match the world size 8"):
        trainer_with(HybridParallelStrategy(1, 2, 2), 8)
    with pytest.raises(ValueError, match="sequence_parallel=True is not supported with pipeline_parallel_size > 1"):
        trainer_with(HybridParallelStrategy(1, 2, 2, sequence_parallel=True), 4)
    with pytest.raises(ValueError, match="data_parallel_shard_size=3 .* must divide data_parallel_size=4"):
        trainer_with(HybridParallelStrategy(4, data_parallel_mode="hybrid_shard", data_parallel_shard_size=3), 4)
    with pytest.raises(ValueError, match="data_parallel_mode='zero2' is unknown"):
        HybridParallelStrategy(data_parallel_mode="zero2")
    with pytest.raises(ValueError, match="comm_hook='fp16' is a DDP gradient hook"):
        HybridParallelStrategy(data_parallel_mode="shard", comm_hook="fp16")
    with pytest.raises(ValueError, match="1f1b.* with 2 stages needs at least 2 micro-batches"):
        trainer_with(HybridParallelStrategy(1, 2, 2, microbatches=1), 4)
    with pytest.raises(TypeError, match="activation_checkpointing must be 'auto' or a list"):
        HybridParallelStrategy(activation_checkpointing=[3])
    with pytest.raises(ValueError, match="use 'auto' alone"):
        HybridParallelStrategy(activation_checkpointing=["auto", "model.blocks.0"])


def test_tensor_parallel_groups_spanning_nodes_warn():
    with pytest.warns(UserWarning, match="tensor_parallel_size=2 does not divide the 3 devices per node"):
        trainer_with(HybridParallelStrategy(3, 2), 3, num_nodes=2)


def test_tensor_parallel_strategy_wiring():
    trainer = L.Trainer(strategy="tensor_parallel", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, TensorParallelStrategy)
    assert trainer.strategy.layout == ParallelLayout(data_parallel_size=1, tensor_parallel_size=2)
    # TP peers read the same batches.
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    # More processes than the TP size: the rest become data-parallel replicas of the TP group.
    trainer = L.Trainer(strategy=TensorParallelStrategy(tensor_parallel_size=2), accelerator="cpu", devices=4, logger=False)
    # TensorParallelStrategy shards the replicas of its TP group by default (data_parallel_mode="shard").
    assert trainer.strategy.layout == ParallelLayout(data_parallel_size=2, tensor_parallel_size=2, data_parallel_shard_size=2)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    with pytest.raises(ValueError, match=r"style 'diagonal' is unknown"):
        TensorParallelStrategy(plan={"model.ln_f": "diagonal"})
    with pytest.raises(ValueError, match=r"plan='manual' is not understood"):
        TensorParallelStrategy(plan="manual")
    with pytest.raises(ValueError, match=r"at least tensor_parallel_size=4 = 4 ranks, but the world size is 2"):
        L.Trainer(strategy=TensorParallelStrategy(tensor_parallel_size=4), accelerator="cpu", devices=2, logger=False)


def test_layout_is_unknown_before_a_trainer_connects():
    with pytest.raises(RuntimeError, match="pass this strategy to a Trainer"):
        _ = DataParallelStrategy().layout
    assert lightning_parallel.__version__
