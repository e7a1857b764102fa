import pytest
import torch
from torch import nn

from lightning_parallel.parallelize.data.batchnorm import (
    CPUSyncBatchNorm,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from recipes.models.convnet import ConvNet


def test_convert_and_revert_keep_parameters_and_classes():
    model = ConvNet(3, 10, 4)
    bn = model.features[1]
    weight, running_var = bn.weight, bn.running_var
    converted = convert_sync_batchnorm(model, None, "cpu")
    assert isinstance(converted.features[1], CPUSyncBatchNorm)
    assert converted.features[1].weight is weight and converted.features[1].running_var is running_var
    reverted = revert_sync_batchnorm(converted)
    assert type(reverted.features[1]) is nn.BatchNorm2d and type(reverted.features[5]) is nn.BatchNorm2d
    assert reverted.features[1].weight is weight


def test_accelerator_devices_get_torch_sync_batchnorm():
    converted = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3)), None, "cuda")
    assert type(converted[0]) is nn.SyncBatchNorm
    assert type(revert_sync_batchnorm(converted)[0]) is nn.BatchNorm1d


def test_without_a_process_group_it_is_plain_batchnorm():
    torch.manual_seed(0)
    reference = nn.BatchNorm2d(4).double()
    synced = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4).double()), None, "cpu")[0]
    x = torch.randn(5, 4, 3, 3, dtype=torch.float64)
    torch.testing.assert_close(synced(x), reference(x))
    torch.testing.assert_close(synced.running_var, reference.running_var)


def test_rejects_inputs_without_channels():
    with pytest.raises(ValueError, match="at least 2D input"):
        CPUSyncBatchNorm(3)(torch.randn(3))


def test_unsynchronized_batchnorm_is_warned_with_the_count_and_the_fix():
    from lightning_parallel.parallelize.data.batchnorm import batch_statistics_layers, unsynchronized_batchnorm_warning

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.BatchNorm2d(8))
    message = unsynchronized_batchnorm_warning(batch_statistics_layers(model, training=True), "Sequential", 2)
    assert message is not None
    assert "2 BatchNorm layers (1, 3)" in message and "sync_batchnorm=True" in message
    assert "trainer.sync_batchnorm=true" in message and "2 data-parallel replicas" in message
    assert unsynchronized_batchnorm_warning([], "Sequential", 2) is None
    assert unsynchronized_batchnorm_warning(["1"], "Sequential", 1) is None


def test_data_parallel_setup_warns_once_about_unsynchronized_batchnorm():
    from types import SimpleNamespace

    from lightning_parallel.parallelize.data.replicated import DataParallelConfig
    from lightning_parallel.parallelize.data.periodic_sync import SyncConfig
    from lightning_parallel.strategies.components.data import DataParallelComponent

    def engine(replicas: int) -> SimpleNamespace:
        layout = SimpleNamespace(pipeline_parallel_size=1, data_parallel_size=replicas)
        return SimpleNamespace(model=nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), _layer_sync=None, layout=layout)

    with pytest.warns(UserWarning, match=r"BatchNorm layers .* sync_batchnorm=True"):
        DataParallelComponent(engine(2), DataParallelConfig(), SyncConfig(), sync_batchnorm=False).prepare(None, fitting=True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DataParallelComponent(engine(1), DataParallelConfig(), SyncConfig(), sync_batchnorm=False).prepare(None, fitting=True)
        DataParallelComponent(engine(2), DataParallelConfig(), SyncConfig(), sync_batchnorm=False).prepare(None, fitting=False)


def _divergent_buffers_worker(rank: int, store_file: str, found: "torch.multiprocessing.Queue") -> None:
    import torch.distributed as dist

    from lightning_parallel.parallelize.data.batchnorm import replica_divergent_buffers

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        module = torch.nn.Module()
        module.register_buffer("running_max", torch.zeros(3))  # a statistic of the batch this replica saw
        module.register_buffer("cache", torch.zeros(4))  # rebuilt the same way on every replica
        module.norm = torch.nn.BatchNorm1d(3)  # judged on its own (sync_batchnorm): left out here
        batch = torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))
        module.running_max.copy_(batch.max(0).values)
        module.cache.copy_(torch.arange(4.0))
        module.norm(batch)
        found.put((rank, replica_divergent_buffers(module, dist.group.WORLD)))
    finally:
        dist.destroy_process_group()


def test_buffers_that_differ_between_replicas_after_a_step_are_named(tmp_path):
    import torch.multiprocessing as mp

    from lightning_parallel.parallelize.data.batchnorm import running_statistics_warning

    context = mp.get_context("spawn")
    found = context.Queue()
    mp.start_processes(_divergent_buffers_worker, args=(str(tmp_path / "store"), found), nprocs=2, start_method="spawn")
    results = dict(found.get(timeout=60) for _ in range(2))
    assert results == {0: ["running_max"], 1: ["running_max"]}
    message = running_statistics_warning(results[0], "IBertForMaskedLM", 2)
    assert "running_max" in message and "differ between data-parallel replicas" in message
    assert running_statistics_warning([], "M", 2) is None and running_statistics_warning(["x"], "M", 1) is None
