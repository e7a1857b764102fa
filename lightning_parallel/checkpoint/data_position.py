"""How far into the epoch a checkpoint was taken, carried over to another number of data-parallel replicas.

A resumable loader (torchdata's ``StatefulDataLoader``, which Lightning saves in the checkpoint) records
the samples *this rank* drew from its ``DistributedSampler`` shard. The replicas together drew that many
times the data-parallel size: under another data-parallel size each rank must skip its share of that
global count, or the resumed run would repeat or skip batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning_parallel.checkpoint.files import INFO_KEY


def saved_data_parallel_size(checkpoint: dict[str, Any]) -> int | None:
    """The number of data-parallel replicas that wrote ``checkpoint`` (``None`` if it does not say)."""
    layout = checkpoint.get(INFO_KEY, {}).get("layout", {})
    return layout.get("dp")


def rescale_loader_positions(checkpoint: dict[str, Any], data_parallel_size: int) -> None:
    """Rewrite, in place, each saved loader position for ``data_parallel_size`` replicas.

    Raises:
        RuntimeError: The samples drawn so far do not divide among the new replicas (the global batch
            size changed mid-epoch): the resumed run could not continue the same order.
    """
    saved = saved_data_parallel_size(checkpoint)
    if saved is None or saved == data_parallel_size:
        return
    for sampler_state in _sampler_states(checkpoint):
        drawn = sampler_state["samples_yielded"] * saved
        if drawn % data_parallel_size:
            raise RuntimeError(
                f"The checkpoint was taken {drawn} samples into the epoch by {saved} data-parallel replica(s); "
                f"{data_parallel_size} replicas cannot split that evenly. Keep the global batch size "
                "(batch_size × data-parallel size) when resuming mid-epoch, or resume from an end-of-epoch checkpoint."
            )
        sampler_state["samples_yielded"] = drawn // data_parallel_size
    checkpoint[INFO_KEY]["layout"]["dp"] = data_parallel_size  # the positions now hold for this many


def _sampler_states(checkpoint: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The sampler positions of the training loaders in a Lightning checkpoint (torchdata's layout)."""
    loops = checkpoint.get("loops", {})
    loaders = loops.get("fit_loop", {}).get("state_dict", {}).get("combined_loader", [])
    for loader in loaders:
        sampler_state = loader.get("_sampler_iter_state") if isinstance(loader, dict) else None
        if isinstance(sampler_state, dict) and isinstance(sampler_state.get("samples_yielded"), int):
            yield sampler_state
