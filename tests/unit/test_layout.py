import pytest

from lightning_parallel import ParallelLayout, RankCoordinates
from lightning_parallel.layout import data_parallel_mesh


def test_fill_resolves_remaining_ranks():
    assert ParallelLayout(data_parallel_size=-1, tensor_parallel_size=2).resolve(8) == ParallelLayout(4, 2, 1)
    assert ParallelLayout(data_parallel_size=2, tensor_parallel_size=-1, pipeline_parallel_size=2).resolve(8).tensor_parallel_size == 2
    assert ParallelLayout().resolve(1) == ParallelLayout(1, 1, 1)


def test_explicit_layout_matching_world_is_returned_unchanged():
    layout = ParallelLayout(2, 2, 2)
    assert layout.resolve(8) is layout
    assert layout.world_size == 8
    assert layout.sizes == (2, 2, 1, 2)  # rank order: pp, dp, cp, tp
    assert layout.describe() == "dp=2 × tp=2 × pp=2"


def test_product_different_from_world_size_names_numbers_and_fix():
    with pytest.raises(ValueError, match=r"data_parallel_size=3 = 3 ranks does not match the world size 4") as info:
        ParallelLayout(data_parallel_size=3).resolve(4)
    assert "data_parallel_size=-1" in str(info.value)


def test_more_ranks_than_world_mentions_how_the_world_came_about():
    with pytest.raises(ValueError, match=r"at least .*= 4 ranks, but the world size is 2 \(devices=2\)") as info:
        ParallelLayout(data_parallel_size=-1, tensor_parallel_size=4).resolve(2, world_description="devices=2")
    assert "trainer.devices=4" in str(info.value)


def test_fill_requires_divisible_world():
    with pytest.raises(ValueError, match=r"data_parallel_size=-1 cannot be filled: the world size 6 is not divisible by .*= 4"):
        ParallelLayout(data_parallel_size=-1, tensor_parallel_size=2, pipeline_parallel_size=2).resolve(6)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"data_parallel_size": 0}, ValueError, "data_parallel_size=0 is invalid"),
        ({"tensor_parallel_size": -2}, ValueError, "tensor_parallel_size=-2 is invalid"),
        ({"data_parallel_size": -1, "pipeline_parallel_size": -1}, ValueError, "Only one size may be -1"),
        ({"data_parallel_size": 2.0}, TypeError, "data_parallel_size must be an int"),
        ({"tensor_parallel_size": True}, TypeError, "tensor_parallel_size must be an int"),
    ],
)
def test_invalid_sizes(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        ParallelLayout(**kwargs)


def test_unresolved_layout_refuses_rank_arithmetic():
    with pytest.raises(RuntimeError, match="call resolve"):
        ParallelLayout().coordinates(0)


def test_coordinates_are_row_major_over_the_axes():
    layout = ParallelLayout(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert layout.coordinates(0) == RankCoordinates(pp=0, dp=0, cp=0, tp=0)
    assert layout.coordinates(1) == RankCoordinates(pp=0, dp=0, cp=0, tp=1)  # TP peers are adjacent ranks
    assert layout.coordinates(2) == RankCoordinates(pp=0, dp=1, cp=0, tp=0)
    assert layout.coordinates(5) == RankCoordinates(pp=1, dp=0, cp=0, tp=1)
    assert [layout.coordinates(r) for r in range(8)] == sorted(layout.coordinates(r) for r in range(8))
    with pytest.raises(ValueError, match="rank=8 is outside"):
        layout.coordinates(8)


def test_group_ranks_partition_the_world():
    layout = ParallelLayout(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert layout.group_ranks("tp", 5) == [4, 5]
    assert layout.group_ranks("dp", 5) == [5, 7]
    assert layout.group_ranks("pp", 5) == [1, 5]
    for dim in ("pp", "dp", "tp"):
        groups = {tuple(layout.group_ranks(dim, r)) for r in range(8)}
        assert sorted(r for g in groups for r in g) == list(range(8))
    with pytest.raises(ValueError, match="not a mesh axis"):
        layout.group_ranks("ep", 0)


def test_named_axes_split_data_parallel_ranks_into_replicas_and_shards():
    # dp=4 as 2 replicas × 2 shards (HSDP): shard peers adjacent, the flattened dp index runs shard-fastest.
    layout = ParallelLayout(data_parallel_size=4, tensor_parallel_size=2, data_parallel_shard_size=2).resolve(8)
    assert layout.axis_sizes == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2}
    assert layout.axis_coordinates(6) == {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "cp": 0, "tp": 0}
    assert layout.coordinates(6).dp == 3
    assert layout.group_ranks("dp_shard", 6) == [4, 6]
    assert layout.group_ranks("dp_replicate", 6) == [2, 6]
    assert layout.group_ranks("dp", 6) == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="data_parallel_shard_size=3 must divide data_parallel_size=4"):
        layout.with_data_parallel_shard_size(3)


def test_layout_round_trips_through_checkpoint_metadata():
    layout = ParallelLayout(4, 2, 2, data_parallel_shard_size=2)
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    # Checkpoints written before named axes recorded pp, dp and tp only.
    assert ParallelLayout.from_dict({"pp": 2, "dp": 2, "tp": 1}) == ParallelLayout(2, 1, 2)


def test_context_parallel_peers_sit_between_tensor_and_data_parallel_ranks():
    layout = ParallelLayout(data_parallel_size=2, tensor_parallel_size=2, context_parallel_size=2).resolve(8)
    assert layout.describe() == "dp=2 × cp=2 × tp=2 × pp=1"
    assert layout.coordinates(3) == RankCoordinates(pp=0, dp=0, cp=1, tp=1)
    assert layout.group_ranks("tp", 0) == [0, 1]
    assert layout.group_ranks("cp", 0) == [0, 2]
    assert layout.group_ranks("dp", 0) == [0, 4]
    # Replicas of the same weights: data-parallel ranks and their cp peers.
    assert layout.group_ranks("dp_cp", 1) == [1, 3, 5, 7]
    assert ParallelLayout.from_dict(layout.to_dict()) == layout


def test_sizes_of_one_are_allowed_everywhere():
    layout = ParallelLayout(1, 1, 1).resolve(1)
    assert layout.coordinates(0) == RankCoordinates(0, 0, 0, 0)
    assert layout.group_ranks("dp", 0) == [0]


def test_build_mesh_names_the_axes_outermost_first(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = ParallelLayout().resolve(1).build_mesh("cpu")
        # dp is split in (replicate, shard) for hybrid sharding and available flattened as "dp".
        assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        assert tuple(mesh.shape) == (1, 1, 1, 1, 1)
        assert [m.size() for m in (mesh["pp"], data_parallel_mesh(mesh), mesh["tp"])] == [1, 1, 1]
        assert mesh["dp_replicate", "dp_shard"].ndim == 2
        with pytest.raises(ValueError, match="data_parallel_shard_size=2 must divide data_parallel_size=1"):
            ParallelLayout(data_parallel_shard_size=2).resolve(1)
    finally:
        dist.destroy_process_group()
