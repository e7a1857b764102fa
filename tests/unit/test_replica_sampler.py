"""ReplicaSampler: replicas split another sampler's order in lockstep, and its state resumes under any replica count."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DataLoader, SequentialSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from lightning_parallel.checkpoint.replica_sampler import (
    ReplicaSampler,
    split_custom_sampler,
)


def shuffled(n: int, seed: int = 0) -> RandomSampler:
    return RandomSampler(range(n), generator=torch.Generator().manual_seed(seed))


def test_global_batches_are_runs_of_the_wrapped_order():
    order = list(shuffled(24))
    replicas = [list(ReplicaSampler(shuffled(24), num_replicas=4, rank=r)) for r in range(4)]
    # Step k's global batch (2 samples per replica) = samples [8k, 8k + 8) of the order, as on one device.
    for step in range(3):
        batch = sorted(i for rank in replicas for i in rank[2 * step : 2 * step + 2])
        assert batch == sorted(order[8 * step : 8 * step + 8])


def test_incomplete_last_group_is_padded_like_distributed_sampler():
    samplers = [ReplicaSampler(SequentialSampler(range(5)), num_replicas=2, rank=r) for r in range(2)]
    assert [len(s) for s in samplers] == [3, 3]
    assert [list(s) for s in samplers] == [[0, 2, 4], [1, 3, 4]]


@pytest.mark.parametrize(("saved_replicas", "resumed_replicas"), [(2, 2), (2, 1), (1, 4), (4, 2)])
def test_state_is_the_whole_groups_position(saved_replicas, resumed_replicas):
    global_batch, steps_done = 4, 2
    order = list(shuffled(32, seed=7))
    iterator = iter(ReplicaSampler(shuffled(32, seed=7), num_replicas=saved_replicas, rank=0))
    for _ in range(steps_done * global_batch // saved_replicas):
        next(iterator)
    state = iterator.state_dict()  # what rank 0 saves
    rest = []
    for rank in range(resumed_replicas):
        resumed = iter(ReplicaSampler(shuffled(32, seed=123), num_replicas=resumed_replicas, rank=rank))
        resumed.load_state_dict(state)
        rest += list(resumed)
    assert sorted(rest) == sorted(order[steps_done * global_batch :])


def test_plain_sampler_gives_a_plain_iterator():
    # Without state of its own, the loader skips a replica's samples on resume (torchdata's fallback).
    assert not hasattr(iter(ReplicaSampler(SequentialSampler(range(4)), 2, 0)), "state_dict")


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank=2, num_replicas=2"):
        ReplicaSampler(SequentialSampler(range(4)), num_replicas=2, rank=2)
    with pytest.raises(TypeError, match="length"):
        ReplicaSampler(iter(range(4)), num_replicas=1, rank=0)


def test_split_custom_sampler_replaces_lightnings_wrapper():
    from lightning.fabric.utilities.data import _update_dataloader

    loader = StatefulDataLoader(list(range(16)), batch_size=2, shuffle=True)
    wrapped = loader.sampler if not isinstance(loader.sampler, SequentialSampler) else loader.batch_sampler.sampler
    injected = _update_dataloader(loader, DistributedSamplerWrapper(wrapped, num_replicas=2, rank=1, shuffle=True))
    split_custom_sampler(injected)
    assert isinstance(injected.batch_sampler.sampler, ReplicaSampler)
    assert injected.batch_sampler.sampler.rank == 1 and injected.batch_sampler.sampler.sampler is wrapped
    assert len(injected) == 4


def test_split_custom_sampler_leaves_other_loaders_alone():
    loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
    assert split_custom_sampler(loader) is loader
    assert not isinstance(loader.batch_sampler.sampler, ReplicaSampler)


def test_resume_with_other_replicas_refuses_a_changed_micro_batch():
    from lightning_parallel.checkpoint.data_position import (
        check_same_global_batch,
        global_batch,
    )

    saved = global_batch(per_replica=4, replicas=2, accumulate=1)
    check_same_global_batch(None, global_batch(4, 1, 1))  # no record: an older checkpoint
    check_same_global_batch(saved, global_batch(16, 2, 1))  # same replicas: a deliberate change is the user's
    check_same_global_batch(saved, global_batch(8, 1, 1))  # fewer replicas, same micro-batch: exact
    with pytest.raises(ValueError, match=r"Keep them: data.batch_size=8 \(per replica\) with trainer.accumulate_grad_batches=1"):
        check_same_global_batch(saved, global_batch(4, 1, 2))  # same global batch, but Lightning counts micro-batches
    with pytest.raises(ValueError, match="a data-parallel size that divides the 8 samples"):
        check_same_global_batch(saved, global_batch(4, 3, 1))
