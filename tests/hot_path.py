"""The training step's host cost, counted: host syncs and library collectives per optimizer step, per layout.

On a GPU every read of a tensor's value on the host (``item``, ``bool(tensor)``, ``tolist`` ...) stalls the stream,
and every small collective is a kernel launch and a rendezvous of all ranks. Lightning's own DDP makes no host
sync and no collective of its own per step (DDP's reducer sends the buckets); the promise here is that no layout's
count grows with the depth of the model or the number of micro-batches, and that each stays within a budget.

Shared by ``tests/distributed/test_hot_path.py`` (the suite's check, in its 4-rank launch) and
``benchmarks/hot_path.py`` (which writes the committed table in ``benchmarks/results/hot_path.{json,md}``).
"""

from __future__ import annotations

from typing import Any

from tests.harness import JobSpec

#: 4-rank layouts: Lightning's DDPStrategy as the reference, then each axis and pair the library adds.
LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "lightning_ddp": ("lightning_ddp", {}),
    "dp4": ("hybrid", {"data_parallel_size": 4}),
    "dp4_shard": ("hybrid", {"data_parallel_size": 4, "data_parallel_mode": "shard"}),
    "dp2xtp2": ("hybrid", {"data_parallel_size": 2, "tensor_parallel_size": 2}),
    "dp2xcp2": ("hybrid", {"data_parallel_size": 2, "context_parallel_size": 2}),
    "dp2xpp2": ("hybrid", {"data_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 4}),
    "tp2xpp2": ("hybrid", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "microbatches": 4}),
    "dp4xep2": ("hybrid", {"data_parallel_size": 4, "expert_parallel_size": 2}),
    "dp4_fp16": ("hybrid", {"data_parallel_size": 4}),
}
#: What a layout's jobs change of the default job beside the strategy: the recipe GPT with a Mixture-of-Experts layer
#: in each block (its experts divided), and fp16 with Lightning's gradient scaler (the strategy's world-agreed one).
JOB_OPTIONS: dict[str, dict[str, Any]] = {
    "dp4xep2": {"model": "gpt_moe"},
    "dp4_fp16": {"precision": "16-mixed"},
}
#: Host reads per MoE layer and forward that a layout makes by design: dropless expert dispatch hands all_to_all its
#: split sizes as Python lists (NCCL's all_to_all too), so each MoE layer reads its token counts once (both
#: directions in one read), as torchtitan's and Megatron's dropless dispatch do. Nothing else may grow with depth.
PER_MOE_LAYER_SYNCS = {"dp4xep2": 1}
#: Blocks of the shallow and the deep model: counts must not depend on it.
DEPTHS = (2, 8)
#: A pipeline with four times the micro-batches: counts must not depend on it either.
MORE_MICROBATCHES = {"dp2xpp2": 16}
ACCUMULATE = 2
STEPS = 3  # optimizer steps; the first builds pipelines and caches: the second and third are counted
BATCH = 16  # rows per data-parallel rank and micro-batch of accumulation (16 pipeline micro-batches of one row)
#: What counts as a host sync: reads of a tensor's value on the host.
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


def job_name(layout: str, depth: int, microbatches: int | None = None) -> str:
    return f"hot_path_{layout}_{depth}_blocks" + (f"_{microbatches}_microbatches" if microbatches else "")


def job(layout: str, depth: int, microbatches: int | None = None) -> JobSpec:
    strategy, kwargs = LAYOUTS[layout]
    kwargs = dict(kwargs)
    if microbatches is not None:
        kwargs["microbatches"] = microbatches
    return JobSpec(
        strategy=strategy, devices=4, batch_size=BATCH, accumulate=ACCUMULATE, steps=STEPS, n_layer=depth,
        gradient_clip_val=1.0, monitor=True, count_host_syncs=True, strategy_kwargs=kwargs, **JOB_OPTIONS.get(layout, {}),
    )


def specs() -> dict[str, JobSpec]:
    """Every job of the count, by name."""
    jobs = {job_name(layout, depth): job(layout, depth) for layout in LAYOUTS for depth in DEPTHS}
    jobs.update({job_name(layout, DEPTHS[0], m): job(layout, DEPTHS[0], m) for layout, m in MORE_MICROBATCHES.items()})
    return jobs


def per_optimizer_step(result: dict[str, Any]) -> list[dict[str, int]]:
    """Each counted optimizer step's (host syncs, library collectives, torch collectives), the most over the ranks.

    The recorder counts per training batch from the second on; with accumulation, an optimizer step is
    ``ACCUMULATE`` batches, and the first whole one counted starts at batch ``ACCUMULATE``.
    """
    worst: list[dict[str, int]] = []
    for batches in result["step_counts"]:
        steps = [batches[i : i + ACCUMULATE] for i in range(ACCUMULATE - 1, len(batches), ACCUMULATE)]
        for index, step in enumerate(s for s in steps if len(s) == ACCUMULATE):
            total = {
                "host_syncs": sum(n for counts in step for what, n in counts.items() if what in HOST_READS),
                "library_collectives": sum(n for counts in step for what, n in counts.items() if what.startswith("library.")),
                # The layers' own exchanges of activations ("activation.*": context parallelism's keys and values,
                # expert dispatch) grow with the layers by design, as tensor parallelism's do: not counted here.
                "torch_collectives": sum(
                    n for counts in step for what, n in counts.items()
                    if what not in HOST_READS and not what.startswith(("library.", "activation."))
                ),
            }
            if index == len(worst):
                worst.append(total)
            else:
                worst[index] = {k: max(v, worst[index][k]) for k, v in total.items()}
    return worst


def table(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per layout: each depth's (and micro-batch count's) worst counted optimizer step, of the jobs in ``results``
    (``benchmarks/hot_path.py --smoke`` runs the 2-block ones only)."""
    rows: dict[str, dict[str, Any]] = {}
    for layout in LAYOUTS:
        row: dict[str, Any] = {}
        for depth in DEPTHS:
            if job_name(layout, depth) in results:
                row[f"{depth}_blocks"] = _worst(per_optimizer_step(results[job_name(layout, depth)]))
        if layout in MORE_MICROBATCHES and job_name(layout, DEPTHS[0], MORE_MICROBATCHES[layout]) in results:
            m = MORE_MICROBATCHES[layout]
            row[f"{DEPTHS[0]}_blocks_{m}_microbatches"] = _worst(per_optimizer_step(results[job_name(layout, DEPTHS[0], m)]))
        rows[layout] = row
    return rows


def _worst(steps: list[dict[str, int]]) -> dict[str, int]:
    if not steps:
        raise AssertionError("no optimizer step was counted (the job ran too few steps)")
    return {key: max(step[key] for step in steps) for key in steps[0]}
