"""Counting the gradient communication that data parallelism issues.

DDP hands each gradient bucket to a communication hook; wrapping the hook lets us count what really
crosses the wire (and what accumulation skips) without patching torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_parallel.measure.device_clock import DeviceClock, Elapsed


@dataclass
class CommStats:
    """Running totals of gradient communication on this rank.

    Attributes:
        bucket_calls: Gradient buckets handed to the communication hook.
        rounds: Backward passes that synchronized gradients (one per optimizer step when accumulation
            skips the sync on intermediate micro-batches).
        bytes: Bytes of uncompressed gradient buckets sent to the hook (compression hooks send fewer).
        exposed_seconds: Time the training thread waited for gradient communication: from the moment the
            last bucket of a backward pass was handed over (its gradients are the last ones computed) until
            it was reduced, plus synchronizations issued outside DDP.
    """

    bucket_calls: int = 0
    rounds: int = 0
    bytes: int = 0
    exposed: Elapsed = field(default_factory=Elapsed, repr=False, compare=False)

    @property
    def exposed_seconds(self) -> float:
        """Seconds of exposed communication (device time on a GPU: read from events here, a window's edge)."""
        return self.exposed.total

    def record(self, bucket: dist.GradBucket) -> None:
        """Account for one bucket; the last bucket of a backward pass closes a round."""
        # DDP's reducer runs hooks one at a time (under its own mutex), so plain counters suffice; a lock
        # would also make the strategy unpicklable for start_method="spawn".
        buffer = bucket.buffer()
        self.bucket_calls += 1
        self.bytes += buffer.numel() * buffer.element_size()
        if bucket.is_last():
            self.rounds += 1

    def record_round(self, nbytes: int, buckets: int = 1, seconds: float = 0.0) -> None:
        """Account for a synchronization issued outside DDP (e.g. a pipeline's replicas at the optimizer step)."""
        self.bucket_calls += buckets
        self.bytes += nbytes
        self.rounds += 1
        self.exposed.add_seconds(seconds)

    def record_transfer(self, nbytes: int) -> None:
        """Account for one collective of sharded data parallelism (an all-gather of parameters or a reduce-scatter
        of gradients), without closing a round."""
        self.bucket_calls += 1
        self.bytes += nbytes

    def reset(self) -> None:
        """Zero all counters (e.g. after a warm-up)."""
        self.bucket_calls = self.rounds = self.bytes = 0
        self.exposed.reset()

    def as_dict(self) -> dict[str, float]:
        """Counters as a plain dict, for logging and JSON."""
        return {"bucket_calls": self.bucket_calls, "rounds": self.rounds, "bytes": self.bytes, "exposed_seconds": self.exposed_seconds}


def counting_comm_hook(
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]], stats: CommStats
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """Wrap a DDP communication hook so that every bucket it sends is recorded in ``stats``."""

    # DDP inspects the hook's signature: the second parameter must be called ``bucket``, and annotations
    # are compared as objects (postponed string annotations would fail that check), so none are given.
    def counted_hook(state, bucket):
        stats.record(bucket)
        future = hook(state, bucket)
        if not bucket.is_last():
            return future
        # On a GPU, marks on the stream (see measure/device_clock.py): the host clock would time the launch only.
        clock = DeviceClock(bucket.buffer().device)
        handed_over = clock.mark()

        def reduced(done):
            stats.exposed.add(handed_over, clock.mark())
            return done.value()

        return future.then(reduced)

    counted_hook.__name__ = f"counted_{getattr(hook, '__name__', 'hook')}"
    return counted_hook
