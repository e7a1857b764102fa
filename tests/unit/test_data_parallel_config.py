import pytest
import torch
from torch import nn

from lightning_parallel import COMM_HOOKS, DataParallelConfig
from lightning_parallel.parallelize.data.replicated import gradient_bytes, unwrap_ddp


def test_defaults_are_exact_allreduce():
    config = DataParallelConfig()
    assert config.comm_hook == "allreduce"
    config.check_backend("gloo")


def test_unknown_comm_hook_lists_the_choices():
    with pytest.raises(ValueError, match=r"comm_hook='topk' is unknown\. Choose one of: allreduce, fp16, bf16, powersgd"):
        DataParallelConfig(comm_hook="topk")


def test_every_documented_hook_is_accepted():
    for name in COMM_HOOKS:
        DataParallelConfig(comm_hook=name)


def test_bf16_hook_needs_nccl():
    config = DataParallelConfig(comm_hook="bf16")
    config.check_backend("nccl")
    with pytest.raises(ValueError, match=r"comm_hook='bf16' needs the NCCL backend .* Use comm_hook='fp16'"):
        config.check_backend("gloo")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"bucket_cap_mb": 0}, "bucket_cap_mb=0 must be positive"),
        ({"powersgd_rank": 0}, "powersgd_rank=0 must be >= 1"),
        ({"powersgd_start_iter": 1}, "powersgd_start_iter=1 must be >= 2"),
    ],
)
def test_invalid_options(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        DataParallelConfig(**kwargs)


def test_gradient_bytes_counts_tied_parameters_once():
    embedding = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    model = nn.ModuleDict({"emb": embedding, "head": head}).double()
    assert gradient_bytes(model) == 10 * 4 * 8
    assert unwrap_ddp(model) is model


def test_torch_ddp_comm_hooks_exist():
    # The hooks we expose by name must exist in this torch.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    assert callable(default_hooks.fp16_compress_hook) and callable(powerSGD_hook.powerSGD_hook)
    assert torch.distributed.is_available()


def test_static_graph_with_accumulation_is_refused():
    DataParallelConfig(static_graph=True).check_accumulation(1)
    DataParallelConfig().check_accumulation(4)
    with pytest.raises(ValueError, match=r"static_graph=True cannot be combined with accumulate_grad_batches=2"):
        DataParallelConfig(static_graph=True).check_accumulation(2)


def test_ddp_finds_unused_parameters_for_replicated_expert_lists() -> None:
    """Experts kept as an nn.ModuleList are called only for the tokens routed to them: replicas disagree on which get
    a gradient, and DDP without find_unused_parameters all-reduced different buckets on each rank (a hang)."""
    from types import SimpleNamespace

    from lightning_parallel.parallelize.data.periodic_sync import SyncConfig
    from lightning_parallel.parallelize.data.replicated import DataParallelConfig
    from lightning_parallel.strategies.components.data import DataParallelComponent
    from tests.hf_models import ListMoELM

    def config(module: nn.Module, ep: int = 1, **options: bool) -> DataParallelConfig:
        layout = SimpleNamespace(expert_parallel_size=ep, data_parallel_size=2)
        engine = SimpleNamespace(lightning_module=module, layout=layout)
        return DataParallelComponent(engine, DataParallelConfig(**options), SyncConfig(), sync_batchnorm=False)._ddp_config()

    moe = ListMoELM(n_layers=1)
    assert config(moe).find_unused_parameters
    assert not config(moe, ep=2).find_unused_parameters  # expert parallelism takes the experts out of DDP
    assert not config(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))).find_unused_parameters
    with pytest.raises(ValueError, match=r"static_graph=True, but layers.0.moe.experts"):
        config(moe, static_graph=True)
