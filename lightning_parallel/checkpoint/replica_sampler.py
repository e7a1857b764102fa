"""Split another sampler's order across data-parallel replicas so that a checkpoint resumes it exactly.

Lightning gives each replica its part of a custom sampler (torchdata's resumable ``RandomSampler`` — what a
``StatefulDataLoader(shuffle=True)`` holds — among them) through ``DistributedSamplerWrapper``. That wrapper
reads the whole order, shuffles it a second time with a fixed seed, and hides the wrapped sampler's state
from the loader: a resumed run draws a *new* order from whatever the random generators hold when the loader
is rebuilt, and continues from the right position of the wrong order.

:class:`ReplicaSampler` reads the wrapped order lazily and in lockstep: each replica takes one index of
every ``num_replicas`` consecutive ones. After ``k`` samples per replica the wrapped iterator has given
``k × num_replicas``, so its own state *is* the position of the whole data-parallel group — the same state
that one device saves. It resumes under any number of replicas, and the global batch of every step is the
same run of the wrapped order that one device with the global batch size would see.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized
from typing import Any

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import DataLoader, Sampler
from torchdata.stateful_dataloader.stateful import Stateful

log = logging.getLogger(__name__)


class ReplicaSampler(Sampler[int]):
    """Replica ``rank`` of ``num_replicas`` takes every ``num_replicas``-th index of ``sampler``'s order.

    Args:
        sampler: The order to split (any sampler; its iterator's ``state_dict`` is what checkpoints hold).
        num_replicas: Data-parallel replicas.
        rank: This replica's data-parallel rank.

    Every replica yields ``ceil(len(sampler) / num_replicas)`` indices: in a last, incomplete group the
    replicas past its end repeat its indices (as ``DistributedSampler`` pads), so replicas never run out of
    batches at different steps.
    """

    def __init__(self, sampler: Sampler[int], num_replicas: int, rank: int) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"ReplicaSampler needs 0 <= rank < num_replicas, got rank={rank}, num_replicas={num_replicas}.")
        if not isinstance(sampler, Sized):
            raise TypeError(f"ReplicaSampler needs a sampler with a length, got {type(sampler).__name__}.")
        self.sampler = sampler
        self.num_replicas = num_replicas
        self.rank = rank

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        order = iter(self.sampler)
        # Stateful only when the wrapped order is: otherwise the loader skips this replica's samples on resume.
        iterator_type = _ResumableLockstep if isinstance(order, Stateful) else _Lockstep
        return iterator_type(order, self.num_replicas, self.rank, len(self))

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler (Lightning calls it at the start of every epoch)."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


class _Lockstep(Iterator[int]):
    """Draws ``num_replicas`` indices from the wrapped order for each one it yields."""

    def __init__(self, order: Iterator[int], num_replicas: int, rank: int, length: int) -> None:
        self.order = order
        self.num_replicas = num_replicas
        self.rank = rank
        self.remaining = length

    def __next__(self) -> int:
        if self.remaining <= 0:
            raise StopIteration
        group: list[int] = []
        for _ in range(self.num_replicas):
            try:
                group.append(next(self.order))
            except StopIteration:
                break
        if not group:
            raise StopIteration
        self.remaining -= 1
        return group[self.rank % len(group)]


class _ResumableLockstep(_Lockstep, Stateful):
    """A lockstep iterator whose state is the wrapped order's: the position of the whole replica group."""

    def state_dict(self) -> dict[str, Any]:
        return self.order.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.order.load_state_dict(state_dict)


def split_custom_sampler(dataloader: DataLoader) -> DataLoader:
    """Replace Lightning's ``DistributedSamplerWrapper`` in ``dataloader`` by a :class:`ReplicaSampler`.

    Loaders with torch's own samplers (Lightning gives them a plain ``DistributedSampler``, whose order is
    a function of seed and epoch, resumable as it is) and loaders without a distributed sampler are left alone.
    """

    batch_sampler = getattr(dataloader, "batch_sampler", None)
    current = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else getattr(dataloader, "sampler", None)
    if not isinstance(current, DistributedSamplerWrapper):
        return dataloader
    # Lightning 2.5/2.6 keep the wrapped sampler on the wrapper's dataset (``_DatasetSamplerWrapper._sampler``).
    wrapped = getattr(current.dataset, "_sampler", None)
    if wrapped is None:
        log.warning("lightning_parallel: cannot find the sampler inside Lightning's DistributedSamplerWrapper; "
                    "a mid-epoch resume may not continue the same order.")
        return dataloader
    replacement = ReplicaSampler(wrapped, num_replicas=current.num_replicas, rank=current.rank)
    if batch_sampler is not None:
        batch_sampler.sampler = replacement
    if getattr(dataloader, "sampler", None) is current:
        # DataLoader refuses to reassign ``sampler`` after construction; the loader iterates through
        # ``batch_sampler`` (set above) and Lightning reads ``sampler`` for set_epoch and lengths.
        object.__setattr__(dataloader, "sampler", replacement)
    return dataloader
