"""The harness's replica check compares the ranks' local shards (issue 55 item 4): ranks holding the same part of a
parameter must hold the same values, while different parts (tensor-parallel or FSDP2 shards) are not compared.
``full_tensor()`` could not tell: its all-gather hands every rank the same whole tensor."""

import math

import torch

from tests.harness import replica_spread


def slots(**parts: torch.Tensor) -> dict:
    """One rank's slots: ``w0=...`` is parameter ``w``'s part at tp coordinate 0, ``b=...`` a replicated one."""
    return {(name[0], (("tp", int(name[1:])),) if len(name) > 1 else ()): value.double() for name, value in parts.items()}


def test_copies_of_one_part_are_compared_and_different_parts_are_not():
    half0, half1, bias = (torch.tensor(v, dtype=torch.float64) for v in ([1.0, 2.0], [3.0, 4.0], [0.5]))
    # tp2 x dp2: ranks 0/2 hold part 0, ranks 1/3 part 1; every rank the replicated bias.
    ranks = [slots(w0=half0, b=bias), slots(w1=half1, b=bias), slots(w0=half0, b=bias), slots(w1=half1, b=bias)]
    assert replica_spread(ranks) == 0.0
    drifted = [*ranks[:3], slots(w1=half1 + torch.tensor([0.0, 1e-6], dtype=torch.float64), b=bias)]  # one replica of one shard moved
    assert math.isclose(replica_spread(drifted), 1e-6, rel_tol=1e-9)
    tp_bias = [slots(w0=half0, b=bias), slots(w1=half1, b=bias + 0.25)]  # a replicated tensor differing across tp
    assert replica_spread(tp_bias) == 0.25


def test_nan_in_one_copy_or_another_shape_is_a_difference():
    assert replica_spread([slots(b=torch.tensor([1.0, 2.0])), slots(b=torch.tensor([1.0, float("nan")]))]) == math.inf
    assert replica_spread([slots(b=torch.tensor([float("nan")])), slots(b=torch.tensor([float("nan")]))]) == 0.0
    assert replica_spread([slots(b=torch.tensor([1.0, 2.0])), slots(b=torch.tensor([1.0]))]) == math.inf
