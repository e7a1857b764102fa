"""The layouts a job could use: every way to split its ranks into dp × tp × pp, with the settings that go with it.

A :class:`Layout` is one full choice (sizes, data-parallel mode, pipeline schedule and micro-batches,
activation checkpointing); :class:`Workload` is what stays fixed while layouts are compared (ranks, nodes,
samples per optimizer step). :func:`enumerate_layouts` lists the valid ones and why the others are not.
No torch here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from lightning_parallel.parallelize.pipeline.schedule import SCHEDULES, check_schedule

if TYPE_CHECKING:
    from lightning_parallel.layout import ParallelLayout
    from lightning_parallel.parallelize.pipeline.config import PipelineConfig

#: Pipeline schedules the planner compares (one stage per rank, and the common virtual-stage ones).
PLANNED_SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b", "zbv_zero_bubble")


@dataclass(frozen=True)
class Workload:
    """What a plan keeps fixed.

    Args:
        devices_per_node: Processes per node (``trainer.devices``).
        num_nodes: Nodes (``trainer.num_nodes``).
        global_batch: Samples per optimizer step, over all replicas and accumulated batches.
        accumulate: Batches accumulated per optimizer step (``trainer.accumulate_grad_batches``).
        empty_init: The model is built on the meta device (``trainer.init_module(empty_init=True)``): each rank
            only ever holds its part. Otherwise pipelines hold the whole model until the first batch cuts it.
    """

    devices_per_node: int
    num_nodes: int
    global_batch: int
    accumulate: int = 1
    empty_init: bool = False

    def __post_init__(self) -> None:
        for name in ("devices_per_node", "num_nodes", "global_batch", "accumulate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int.")

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.num_nodes


@dataclass(frozen=True)
class Layout:
    """One complete parallel layout.

    Attributes:
        dp, tp, pp: Data-, tensor- and pipeline-parallel sizes (mesh order ``(pp, dp, cp, tp)``).
        data_parallel_mode: ``replicate`` (DDP), ``shard`` (FSDP2 over all of dp), ``hybrid_shard``.
        shard_size: Ranks that shard one replica (``shard``: dp; ``hybrid_shard``: the dp ranks of a node).
        schedule: Pipeline schedule (``none`` without pipeline parallelism).
        stages_per_rank: Virtual stages per pipeline rank.
        microbatches: Micro-batches per batch (1 without pipeline parallelism).
        activation_checkpointing: Each trunk layer recomputed in backward.
        cp: Context-parallel size (each sequence split over ``cp`` ranks, ring attention).
        ep: Expert-parallel size (of the dp ranks, how many divide each MoE layer's routed experts).
        gradient_as_bucket_view: DDP's gradients alias its communication buckets (else DDP keeps a second copy).
    """

    dp: int
    tp: int
    pp: int
    data_parallel_mode: str = "replicate"
    shard_size: int = 1
    schedule: str = "none"
    stages_per_rank: int = 1
    microbatches: int = 1
    activation_checkpointing: bool = False
    cp: int = 1
    ep: int = 1
    gradient_as_bucket_view: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @classmethod
    def from_parallel(
        cls,
        layout: ParallelLayout,
        data_parallel_mode: str,
        pipeline: PipelineConfig,
        activation_checkpointing: bool,
        gradient_as_bucket_view: bool = False,
    ) -> Layout:
        """A strategy's resolved layout and settings in the planner's terms (options that do not apply dropped)."""
        pipelined = layout.pipeline_parallel_size > 1
        return cls(
            dp=layout.data_parallel_size,
            tp=layout.tensor_parallel_size,
            pp=layout.pipeline_parallel_size,
            data_parallel_mode=data_parallel_mode if layout.data_parallel_size > 1 else "replicate",
            shard_size=layout.data_parallel_shard_size,
            schedule=pipeline.schedule if pipelined else "none",
            stages_per_rank=pipeline.stages_per_rank if pipelined else 1,
            microbatches=pipeline.microbatches if pipelined else 1,
            activation_checkpointing=activation_checkpointing,
            cp=layout.context_parallel_size,
            ep=layout.expert_parallel_size,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )

    @property
    def uses_ddp(self) -> bool:
        """Replicas synchronised by DDP (with its gradient buckets): plain replicated parameters, no pipeline."""
        return self.data_parallel_mode == "replicate" and self.dp * self.cp > 1 and self.tp == 1 and self.pp == 1

    def describe(self) -> str:
        """E.g. ``dp=2 × tp=4 × pp=2 · 1f1b m=8 · shard · ckpt`` (``× cp=2`` after dp when the sequence is split)."""
        context = f" × cp={self.cp}" if self.cp > 1 else ""
        parts = [f"dp={self.dp}{context} × tp={self.tp} × pp={self.pp}"]
        if self.pp > 1:
            virtual = f" v={self.stages_per_rank}" if self.stages_per_rank > 1 else ""
            parts.append(f"{self.schedule}{virtual} m={self.microbatches}")
        if self.data_parallel_mode != "replicate":
            parts.append(self.data_parallel_mode + (f"({self.shard_size})" if self.data_parallel_mode == "hybrid_shard" else ""))
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.activation_checkpointing:
            parts.append("ckpt")
        return " · ".join(parts)

    def overrides(self, batch_size: int) -> list[str]:
        """Hydra overrides that run this layout with the recipes (``strategy=hybrid``)."""
        result = [
            "strategy=hybrid",
            f"strategy.data_parallel_size={self.dp}",
            f"strategy.tensor_parallel_size={self.tp}",
            f"strategy.pipeline_parallel_size={self.pp}",
            f"data.batch_size={batch_size}",
        ]
        if self.cp > 1:
            result.insert(2, f"strategy.context_parallel_size={self.cp}")
        if self.ep > 1:
            result.insert(2, f"strategy.expert_parallel_size={self.ep}")
        if self.pp > 1:
            result += [f"strategy.schedule={self.schedule}", f"strategy.microbatches={self.microbatches}",
                       f"strategy.stages_per_rank={self.stages_per_rank}"]
        if self.data_parallel_mode != "replicate":
            result.append(f"strategy.data_parallel_mode={self.data_parallel_mode}")
            if self.data_parallel_mode == "hybrid_shard":
                result.append(f"strategy.data_parallel_shard_size={self.shard_size}")
        if self.activation_checkpointing:
            result.append("strategy.activation_checkpointing=auto")
        return result

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def batch_per_forward(layout: Layout, workload: Workload) -> int | None:
    """Samples one replica feeds through one forward (``data.batch_size``), or ``None`` if it does not divide."""
    replicas_and_batches = layout.dp * workload.accumulate
    if workload.global_batch % replicas_and_batches:
        return None
    return workload.global_batch // replicas_and_batches


def tensor_parallel_sizes(world_size: int, fixed: Mapping[str, int] | None = None) -> tuple[int, ...]:
    """The tensor-parallel degrees worth profiling for ``world_size`` ranks: its divisors, or 1 and a pinned ``tp``."""
    pinned = (fixed or {}).get("tp")
    return tuple(d for d in _divisors(world_size) if pinned is None or d in (1, pinned))


def enumerate_layouts(
    workload: Workload,
    trunk_layers: int,
    tensor_parallel_sizes: set[int],
    devices_per_node: int,
    fixed: dict[str, int] | None = None,
    experts: int = 0,
    expert_lists: bool = False,
) -> tuple[list[Layout], dict[str, str]]:
    """Every valid layout, and for each (dp, tp, pp) left out, why.

    Args:
        workload: Ranks, nodes and batch.
        trunk_layers: Layers a pipeline can split between.
        tensor_parallel_sizes: Degrees the model's tensor-parallel plan can split by.
        devices_per_node: Devices of one node in the hardware (where hybrid sharding shards).
        fixed: Sizes the user pinned, e.g. ``{"tp": 4}`` (``ep``, a part of dp, too).
        experts: What every expert-parallel size must divide (the MoE layers' expert counts' common divisor);
            0 for a model without routed experts. Expert parallelism divides dp's ranks; inside pipelines only
            without tp or cp (what the strategy combines it with; replicated or sharded dp).
        expert_lists: Some MoE block keeps its experts as an ``nn.ModuleList``: expert parallelism then runs inside
            pipelines only without tp or cp (the combinations tested), on a model not built on the meta device
            (the strategy refuses that).
    """
    fixed = dict(fixed or {})
    pinned_ep = fixed.pop("ep", None)
    # Context parallelism is compared only when pinned: whether it applies depends on the sequence length and
    # on the model's attention (F.scaled_dot_product_attention), which the dry run does not judge.
    cp = fixed.get("cp", 1)
    world = workload.world_size
    layouts: list[Layout] = []
    rejected: dict[str, str] = {}
    if world % cp:
        return layouts, {f"cp={cp}": f"cp={cp} does not divide the world size {world}"}
    for tp in _divisors(world // cp):
        for pp in _divisors(world // (cp * tp)):
            dp = world // (cp * tp * pp)
            sizes = {"dp": dp, "cp": cp, "tp": tp, "pp": pp}
            key = f"dp={dp}{f' × cp={cp}' if cp > 1 else ''} × tp={tp} × pp={pp}"
            if any(sizes[dim] != size for dim, size in fixed.items()):
                continue
            if tp > 1 and tp not in tensor_parallel_sizes:
                rejected[key] = f"the tensor-parallel plan cannot split the model {tp} ways"
                continue
            if pp > 1 and pp > trunk_layers:
                rejected[key] = f"pp={pp} needs more stages than the model's {trunk_layers} trunk layers"
                continue
            batch = batch_per_forward(Layout(dp, tp, pp), workload)
            if batch is None:
                rejected[key] = (
                    f"the global batch {workload.global_batch} does not divide into dp={dp} replicas × "
                    f"{workload.accumulate} accumulated batches"
                )
                continue
            found = list(_variants(dp, tp, pp, batch, trunk_layers, devices_per_node, cp))
            if not found:
                rejected[key] = f"no pipeline schedule fits {batch} samples per batch into enough micro-batches for pp={pp}"
            lists_refused = expert_lists and (workload.empty_init or (pp > 1 and tp * cp > 1))
            sizes = _expert_parallel_sizes(dp, experts, pinned_ep, lists_refused)
            if isinstance(sizes, str):
                rejected[key] = sizes
                continue
            # Expert parallelism combines with every layout (tp and cp inside pipelines too), whatever the
            # data-parallel mode.
            layouts.extend(dataclasses.replace(layout, ep=ep) for layout in found for ep in sizes)
    return layouts, rejected


def _expert_parallel_sizes(dp: int, experts: int, pinned: int | None, lists_refused: bool = False) -> tuple[int, ...] | str:
    """The expert-parallel sizes to compare for one dp, or why a pinned one cannot apply
    (``lists_refused``: nn.ModuleList experts, in a pipeline with tp or cp, or built on the meta device)."""
    possible = tuple(ep for ep in _divisors(dp) if ep == 1 or (experts and experts % ep == 0 and not lists_refused))
    if pinned is None:
        return possible
    if pinned in possible:
        return (pinned,)
    if not experts:
        return f"ep={pinned}: the model holds no routed experts"
    if lists_refused and experts % pinned == 0 and dp % pinned == 0:
        return (f"ep={pinned}: experts kept as an nn.ModuleList are divided neither inside pipelines with tp or cp nor "
                f"on a model built on the meta device (empty_init) yet")
    return f"ep={pinned} must divide dp={dp} and the {experts} experts of every MoE layer"


def _variants(dp: int, tp: int, pp: int, batch: int, trunk_layers: int, devices_per_node: int, cp: int = 1):
    for mode, shard_size in _data_parallel_modes(dp, tp * cp, pp, devices_per_node):
        for schedule, virtual, microbatches in _pipelines(pp, batch, trunk_layers):
            for checkpointing in (False, True) if trunk_layers else (False,):  # "auto" checkpoints trunk layers
                yield Layout(dp, tp, pp, mode, shard_size, schedule, virtual, microbatches, checkpointing, cp)


def _data_parallel_modes(dp: int, tp: int, pp: int, devices_per_node: int):
    yield "replicate", 1
    if dp > 1:
        yield "shard", dp
        per_node = max(1, devices_per_node // tp)
        if 1 < per_node < dp and dp % per_node == 0:
            yield "hybrid_shard", per_node


def _pipelines(pp: int, batch: int, trunk_layers: int):
    if pp == 1:
        yield "none", 1, 1
        return
    for schedule in PLANNED_SCHEDULES:
        spec = SCHEDULES[schedule]
        virtual = spec.exact_stages_per_rank or (2 if spec.multi_stage else 1)
        if pp * virtual > trunk_layers:
            continue
        for microbatches in _microbatch_choices(pp, batch):
            try:
                check_schedule(schedule, pp, virtual, microbatches)
            except ValueError:
                continue
            yield schedule, virtual, microbatches


def _microbatch_choices(pp: int, batch: int) -> list[int]:
    """Micro-batch counts worth comparing: divisors of the batch from pp up, doubling, and the whole batch."""
    divisors = [d for d in _divisors(batch) if d >= pp]
    chosen = [d for d in divisors if d in {pp, 2 * pp, 4 * pp, 8 * pp}]
    if divisors and divisors[-1] not in chosen:
        chosen.append(divisors[-1])
    if divisors and not chosen:
        chosen.append(divisors[0])
    return chosen


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
