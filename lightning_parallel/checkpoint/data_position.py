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


def global_batch(per_replica: int, replicas: int, accumulate: int) -> dict[str, int]:
    """How the samples of one optimizer step are made up, as a checkpoint records it."""
    return {"per_replica": per_replica, "replicas": replicas, "accumulate": accumulate}


def check_same_global_batch(saved: dict[str, int] | None, current: dict[str, int]) -> None:
    """Refuse to resume with another number of replicas unless every micro-batch keeps its samples.

    A restart onto fewer (or more) ranks re-derives the data-parallel size; with the same per-replica batch
    every step would then average another number of samples — a different training, silently. The samples
    of one micro-batch over all replicas (and the accumulation) must stay: the loader's position and
    Lightning's count of the epoch's batches are carried over in those units. A deliberate change of batch
    size with the same replicas is the user's to make and passes.

    Raises:
        ValueError: The replica count changed and the micro-batch or the accumulation with it; the message
            gives the per-replica batch size that keeps them.
    """
    if not saved or saved.get("replicas") == current["replicas"]:
        return
    before = saved["per_replica"] * saved["replicas"]
    now = current["per_replica"] * current["replicas"]
    if before == now and saved["accumulate"] == current["accumulate"]:
        return
    if before % current["replicas"] == 0:
        fix = f"data.batch_size={before // current['replicas']} (per replica) with trainer.accumulate_grad_batches={saved['accumulate']}"
    else:
        fix = (f"a data-parallel size that divides the {before} samples of a micro-batch (or resume from a checkpoint "
               "at an epoch's end with a new batch size)")
    raise ValueError(
        f"The checkpoint was trained with {before} samples per micro-batch ({saved['replicas']} data-parallel replica(s) × "
        f"{saved['per_replica']}) and {saved['accumulate']} accumulated per optimizer step; this run has "
        f"{current['replicas']} × {current['per_replica']} = {now} and {current['accumulate']}. Resuming would change the "
        f"training. Keep them: {fix}."
    )
