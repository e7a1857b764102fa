"""What one layout costs: memory per rank, bytes communicated per step, pipeline bubble, step time, speedup.

The step-time model is the seed document's S = T_compute / (T_compute/k + T_comm), extended to three
dimensions. For the slowest rank, with b samples per micro-batch, m micro-batches, a accumulated batches:

    T_micro    = F_rank · b / FLOP/s  +  T_tp(b)  +  T_p2p(b)        (TP and stage transfers sit on the critical path)
    T_batch    = m · T_micro / (1 − bubble)                          (bubble = (p−1)/(m+p−1) for GPipe/1F1B)
                 (on a node whose processes outnumber its cores, the v·m+p−1 slots of the schedule each take T_micro/v at
                 the rate of the processes computing in that slot: fewer in the warm-up and cool-down)
    T_step     = a · T_batch + T_dp                                   (one gradient synchronization per step)
    S          = T_single / T_step,   efficiency = S / k              (T_single: one device, whole global batch)

Communication is taken as exposed (not hidden behind compute): the synchronous case of the seed. A
collective over ``n`` ranks moving ``B`` bytes costs ``latency + wire(B)/bandwidth`` with ring wire bytes
``2(n−1)/n·B`` (all-reduce) or ``(n−1)/n·B`` (all-gather, reduce-scatter); groups that span nodes use the
inter-node link. Memory per rank: its stages' parameters (split by TP, sharded by FSDP), gradients alike,
optimizer state as the module's optimizer keeps it, and the activations of the micro-batches in flight.
No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from itertools import pairwise

from lightning_parallel.plan.hardware import HardwareProfile
from lightning_parallel.plan.layouts import Layout, Workload, batch_per_forward
from lightning_parallel.plan.profile import AFTER, BEFORE, ModelProfile, StepProfile

#: DDP's default bucket size: one all-reduce (one latency) per bucket.
DDP_BUCKET_BYTES = 25 * 2**20

#: Share of the warm-up/cool-down bubble a zero-bubble schedule still leaves (its B/W split fills the rest
#: when forward, input-gradient and weight-gradient work take about equal time).
ZERO_BUBBLE_REMAINDER = 1 / 3


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes held by one pipeline rank (every rank of one pipeline position holds the same)."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    transient: float = 0.0  # gathered FSDP parameters, recomputed layer under checkpointing
    setup: float = 0.0  # held while the strategy sets the model up, before training
    # Beside the state during the optimizer step, once the step's activations are gone: the optimizer's own
    # temporaries, and DDP's bucket copy of the gradients (kept for the whole run)
    optimizer_step: float = 0.0
    runtime: float = 0.0  # the training runtime and a pipeline's tracing runtime, where the device's memory is the host's
    # Beside the state at the end of backward: a vocabulary-split table's lookup gradient added to its tied head's
    lookup_backward: float = 0.0

    @property
    def state(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.runtime + self.activations + self.transient

    @property
    def peak(self) -> float:
        """The most this rank holds: in forward and backward, in the optimizer step, or during setup."""
        return max(self.total, self.state + self.runtime + max(self.optimizer_step, self.lookup_backward), self.setup)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "state": self.state, "total": self.total, "peak": self.peak}


@dataclass(frozen=True)
class Prediction:
    """Everything predicted for one layout (times in seconds per optimizer step, bytes per rank per step).

    ``comm_bytes`` are payload bytes handed to collectives by pipeline rank 0 (what the monitor counts):
    ``dp`` the gradients synchronized, ``tp`` DTensor's collectives, ``pp`` activations and gradients sent
    between stages; ``comm_bytes_by_pp_rank`` the same for every pipeline rank. ``wire_bytes`` is what the ring
    algorithm moves for pipeline rank 0's.
    """

    layout: Layout
    batch_size: int  # data.batch_size: samples per replica per forward
    memory: list[RankMemory]  # by pipeline rank
    usable_memory: float
    comm_bytes: dict[str, float]
    wire_bytes: dict[str, float]
    compute_s: float
    tp_s: float
    p2p_s: float
    dp_s: float
    bubble_fraction: float
    step_s: float
    single_device_step_s: float
    world_size: int
    accumulate: int
    notes: list[str] = field(default_factory=list)
    cp_s: float = 0.0  # ring attention's key/value traffic (none of it counted as overlapped)
    ep_s: float = 0.0  # expert parallelism's token all-to-alls (none of it counted as overlapped)
    comm_bytes_by_pp_rank: list[dict[str, float]] = field(default_factory=list)

    @property
    def peak_memory(self) -> float:
        return max(m.peak for m in self.memory)

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.usable_memory

    @property
    def comm_s(self) -> float:
        return self.tp_s + self.cp_s + self.ep_s + self.p2p_s + self.dp_s

    @property
    def bubble_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s - self.comm_s)

    @property
    def compute_share(self) -> float:
        """compute / step: the seed's efficiency (T/k) / (T/k + T_comm), bubble counted as waiting."""
        return self.compute_s / self.step_s

    @property
    def speedup(self) -> float:
        return self.single_device_step_s / self.step_s

    @property
    def efficiency(self) -> float:
        return self.speedup / self.world_size

    @property
    def samples_per_s(self) -> float:
        return self.layout.dp * self.batch_size * self.accumulate / self.step_s

    def as_dict(self) -> dict[str, object]:
        return {
            "layout": self.layout.as_dict(),
            "describe": self.layout.describe(),
            "batch_size": self.batch_size,
            "fits": self.fits,
            "peak_memory_bytes": self.peak_memory,
            "usable_memory_bytes": self.usable_memory,
            "memory_by_pipeline_rank": [m.as_dict() for m in self.memory],
            "comm_bytes": self.comm_bytes,
            "comm_bytes_by_pipeline_rank": self.comm_bytes_by_pp_rank,
            "wire_bytes": self.wire_bytes,
            "seconds": {"compute": self.compute_s, "tp": self.tp_s, "cp": self.cp_s, "ep": self.ep_s, "p2p": self.p2p_s, "dp": self.dp_s,
                        "bubble": self.bubble_s, "step": self.step_s, "single_device": self.single_device_step_s},
            "bubble_fraction": self.bubble_fraction,
            "speedup": self.speedup,
            "efficiency": self.efficiency,
            "compute_share": self.compute_share,
            "samples_per_s": self.samples_per_s,
            "notes": self.notes,
            "overrides": self.layout.overrides(self.batch_size),
        }


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle share of a pipeline's batch: (p−1)/(m+p−1), with v virtual stages (p−1)/(v·m+p−1)."""
    if pp <= 1:
        return 0.0
    idle = (pp - 1) / (stages_per_rank * microbatches + pp - 1)
    if "zero_bubble" in schedule or schedule == "dualpipev":
        idle *= ZERO_BUBBLE_REMAINDER
    return idle


def in_flight_microbatches(schedule: str, pp: int, pp_rank: int, microbatches: int, stages_per_rank: int) -> float:
    """Micro-batches whose activations one pipeline rank holds at its peak (in units of its whole stage set)."""
    if pp <= 1:
        return 1.0
    if schedule in ("gpipe", "looped_bfs"):
        return float(microbatches)
    warmup = min(microbatches, pp - pp_rank)
    if stages_per_rank > 1:  # interleaving warms up (p−1)/(p·v) more of the rank's work (Megatron's estimate)
        return min(float(microbatches), warmup * (1 + (pp - 1) / (pp * stages_per_rank)))
    return float(warmup)


def predict(
    profile: ModelProfile, layout: Layout, workload: Workload, hardware: HardwareProfile, shard_index: int = 0
) -> Prediction:
    """Predict memory, communication and time of ``layout`` (see module doc). Memory is that of the ranks at
    ``shard_index`` in their sharding group (:func:`shard_index_of`; the first, the default, holds the most).

    Raises:
        ValueError: The layout does not fit the workload (batch, ranks) or the model.
    """
    world = layout.world_size
    if world != workload.world_size:
        raise ValueError(f"{layout.describe()} uses {world} ranks but the job has {workload.world_size}.")
    batch = batch_per_forward(layout, workload)
    if batch is None or batch % layout.microbatches:
        raise ValueError(
            f"{layout.describe()}: the global batch {workload.global_batch} does not split into dp={layout.dp} × "
            f"{workload.accumulate} accumulated batches × {layout.microbatches} micro-batches."
        )
    # Under ep tensor parallelism leaves the experts whole: every tp peer computes (and saves for backward) the pairs its
    # tokens route to them.
    step = profile.step(layout.tp).with_whole_experts() if layout.ep > 1 else profile.step(layout.tp)
    unsplit = profile.step(1)
    micro = batch / layout.microbatches
    # Processes outnumbering the cores make each message of a collective wait for its receiver to be scheduled again.
    processes = min(workload.devices_per_node, world)
    hardware = hardware.sharing_node(processes)
    rank_stages = _stages_by_pipeline_rank(profile, layout)
    shards = _shard_ranks(layout)
    # Context parallelism: each rank runs 1/cp of every sample's tokens (compute, activations, TP traffic).
    tokens = 1.0 / layout.cp

    memory, micro_times, compute, tp_bytes, tp_seconds, p2p_bytes, p2p_seconds, grad_bytes = [], [], [], [], [], [], [], []
    shares: list[float] = []  # each pipeline rank's part of the trunk's layers
    ep_bytes, ep_seconds, expert_grad_bytes, optimizer_seconds = [], [], [], []
    ring_seconds: list[float] = []
    rank_work: list[tuple[list[list[str]], float]] = []  # each pipeline rank's stages and FLOPs per sample
    for pp_rank, stages in enumerate(rank_stages):
        segments = [segment for stage in stages for segment in stage]
        names = _parameters_of(step, segments)
        experts = names & step.expert_parameters if layout.ep > 1 else set()
        dense = names - experts
        # Divided experts: 1/ep of each, held whole by the data-parallel mode (FSDP2 and DDP leave them alone).
        gradients = sum(step.parameter_bytes[n] for n in dense - step.frozen)
        # Shard rank shard_index's part (FSDP2 cuts dim 0 in whole rows; 1/shards of each only where rows divide).
        held_params = step.shard_bytes(step.parameter_bytes, dense, shards, shard_index)
        held_gradients = step.shard_bytes(step.parameter_bytes, dense - step.frozen, shards, shard_index)
        held_optimizer = step.shard_bytes(step.optimizer_bytes, dense, shards, shard_index)
        # Tensor parallelism leaves divided experts whole (its plan excludes them): their bytes are the unsplit ones.
        expert_params = sum(unsplit.parameter_bytes[n] for n in experts) / layout.ep
        expert_gradients = sum(unsplit.parameter_bytes[n] for n in experts - step.frozen) / layout.ep
        expert_optimizer = sum(unsplit.optimizer_bytes.get(n, 0) for n in experts) / layout.ep
        flops = sum(step.flops[s] for s in segments) + (
            sum(step.forward_flops[s] for s in segments if s not in (BEFORE, AFTER)) if layout.activation_checkpointing else 0.0
        )
        share = 1.0 if layout.pp == 1 else _trunk_share(profile, segments)
        timed = _micro_seconds(hardware, profile, step, layout, workload, stages, flops, micro, processes)  # every process computing
        rank_work.append((stages, flops))
        # Sharded parameters are DTensors (FSDP2); divided experts are plain local tensors.
        optimizer_seconds.append(_optimizer_seconds(hardware, step, dense - step.frozen, shards, processes, sharded=shards > 1)
                                 + _optimizer_seconds(hardware, unsplit, experts - step.frozen, layout.ep, processes, sharded=False))
        in_flight = in_flight_microbatches(layout.schedule, layout.pp, pp_rank, layout.microbatches, layout.stages_per_rank)
        memory.append(
            RankMemory(
                parameters=held_params + expert_params,
                gradients=held_gradients + expert_gradients,
                optimizer=held_optimizer + expert_optimizer,
                activations=_activation_bytes(profile, step, segments, layout.activation_checkpointing) * micro * in_flight * tokens,
                transient=_transient_bytes(profile, step, segments, layout, micro, shards),
                optimizer_step=_optimizer_step_bytes(step, unsplit, layout, dense - step.frozen, experts - step.frozen, shards),
                runtime=hardware.training_runtime_bytes + (hardware.pipeline_runtime_bytes if layout.pp > 1 else 0.0),
                lookup_backward=_lookup_backward_bytes(profile, step, dense - step.frozen, shards),
                setup=_setup_bytes(step, held_params + expert_params, layout, workload),
            )
        )
        micro_times.append(timed.seconds)
        shares.append(share)
        ep_bytes.append(timed.ep_bytes)
        ep_seconds.append(timed.ep)
        ring_seconds.append(timed.ring)
        compute.append(timed.compute)
        tp_bytes.append(timed.tp_bytes)
        tp_seconds.append(timed.tp)
        p2p_bytes.append(timed.p2p_bytes)
        p2p_seconds.append(timed.p2p)
        grad_bytes.append(gradients)
        expert_grad_bytes.append(expert_gradients)

    slowest = max(range(len(micro_times)), key=micro_times.__getitem__)
    bubble = bubble_fraction(layout.schedule, layout.pp, layout.microbatches, layout.stages_per_rank)
    batches = workload.accumulate * layout.microbatches
    batch_seconds = layout.microbatches * micro_times[slowest] / (1 - bubble)
    # The slowest rank's busy time per batch, by part (compute, tp, p2p, ep, ring): m micro-batches in the steady state.
    busy = [batches / workload.accumulate * t for t in (compute[slowest], tp_seconds[slowest], p2p_seconds[slowest],
                                                          ep_seconds[slowest], ring_seconds[slowest])]
    if layout.pp > 1:
        # The bubble's warm-up and cool-down run fewer processes at once than the steady state: on a node whose
        # processes outnumber its cores, those that compute then get more of them (their rank's work there too).
        stages, flops = rank_work[slowest]
        counts = computing_processes(layout, processes, hardware.host_cores or processes)
        at_once = {n: _micro_seconds(hardware.sharing_node(n), profile, step, layout, workload, stages, flops, micro, n) for n in set(counts)}
        batch_seconds = pipelined_batch_seconds(layout, counts, micro_times[slowest], {n: t.seconds for n, t in at_once.items()})
        window = rank_slots(layout, counts, slowest)
        busy = [sum(getattr(at_once[n], part) for n in window) / layout.stages_per_rank for part in ("compute", "tp", "p2p", "ep", "ring")]
    dp_seconds, _, dp_wire = _data_parallel_seconds(hardware, layout, workload, max(grad_bytes))
    # Divided experts' gradients: one all-reduce over the dp / ep ranks holding the same experts (and their cp peers).
    expert_replicas = layout.dp // layout.ep * layout.cp if layout.ep > 1 else 1
    expert_dp_bytes = expert_grad_bytes[0] if expert_replicas > 1 else 0.0
    dp_seconds += _collective_seconds(hardware, expert_replicas, max(expert_grad_bytes), 1, _dp_crosses(layout, workload), "all_reduce")
    dp_wire += _ring_factor(expert_replicas, "all_reduce") * expert_dp_bytes
    # Every rank steps its optimizer after the last batch; the step ends with the slowest.
    step_seconds = workload.accumulate * batch_seconds + dp_seconds + max(optimizer_seconds)
    ring_received = batches * (_ring_bytes(profile, layout, micro, shares[0])[1]
                               + _output_gather_bytes(profile, layout, rank_stages[0], micro) * (layout.cp - 1))
    comm_by_rank = [
        {"dp": dp_payload_rank0(layout, grad_bytes[r], workload) + (expert_grad_bytes[r] if expert_replicas > 1 else 0.0),
         "tp": tp_bytes[r] * batches,
         "cp": batches * (_ring_bytes(profile, layout, micro, shares[r])[0] + _output_gather_bytes(profile, layout, rank_stages[r], micro)),
         "pp": p2p_bytes[r] * batches, "ep": ep_bytes[r] * batches}
        for r in range(len(rank_stages))
    ]
    whole = profile.step(1)
    single = _compute_seconds(hardware, whole, list(profile.segments), sum(whole.flops.values()), workload.global_batch, 1.0, 1)
    single += _optimizer_seconds(hardware, whole, set(whole.parameter_bytes) - whole.frozen, 1, 1, sharded=False)
    notes = _notes(layout, workload, hardware)
    return Prediction(
        layout=layout,
        batch_size=batch,
        memory=memory,
        usable_memory=hardware.usable_memory_bytes,
        comm_bytes=comm_by_rank[0],
        comm_bytes_by_pp_rank=comm_by_rank,
        wire_bytes={"dp": dp_wire, "tp": _ring_factor(layout.tp, "all_reduce") * tp_bytes[0] * batches,
                    "cp": ring_received, "pp": p2p_bytes[0] * batches,
                    "ep": ep_bytes[0] * batches * (layout.ep - 1) / layout.ep},
        compute_s=workload.accumulate * busy[0] + max(optimizer_seconds),
        tp_s=workload.accumulate * busy[1],
        p2p_s=workload.accumulate * busy[2],
        dp_s=dp_seconds,
        cp_s=workload.accumulate * busy[4],
        ep_s=workload.accumulate * busy[3],
        bubble_fraction=bubble,
        step_s=step_seconds,
        single_device_step_s=single,
        world_size=world,
        accumulate=workload.accumulate,
        notes=notes,
    )


def dp_payload_rank0(layout: Layout, gradient_bytes: float, workload: Workload) -> float:
    """Gradient bytes pipeline rank 0 hands to data-parallel collectives per optimizer step."""
    if layout.dp * layout.cp == 1:
        return 0.0
    if _shard_ranks(layout) == 1:
        return gradient_bytes
    # Sharded: every batch gathers the parameters (twice when resharded after forward), one reduce-scatter per step;
    # pipeline stages gather once per optimizer step and keep them over every micro-batch.
    return gradient_bytes * (_gathers_per_step(layout, workload) + 1)


# ---------------------------------------------------------------------------------------------- pieces


def _compute_seconds(
    hardware: HardwareProfile, step: StepProfile, segments: list[str], flops: float, samples: float, share: float, processes: int,
) -> float:
    """One rank's compute for ``samples`` on ``segments`` (``flops`` per sample; ``share``: its part of the trunk).

    With a measured host (``hardware.memory_gbps``), a roofline of measured figures: matmul FLOPs at the peak their
    kinds reach, the bytes the other operators move at the memory bandwidth, and the host time of every operator the
    step dispatches (per micro-batch, whatever its size; DTensor's dearer). Otherwise FLOPs at the achievable
    fraction of the peak, plus DTensor's host time where measured.
    """
    dtensor = step.dtensor_ops * share * hardware.dtensor_op_seconds(processes)
    if hardware.memory_gbps is None:
        return flops * samples / hardware.flops_per_device(processes) + dtensor
    moved = sum(step.memory_bytes.get(s, 0.0) for s in segments)
    host = step.ops * share * hardware.op_seconds(processes)
    matmuls = flops * samples * hardware.matmul_slowdown(step.matmul_flops_by_kind) / hardware.matmul_flops_per_device(processes)
    return matmuls + moved * samples / hardware.memory_bytes_per_second(processes) + host + dtensor


@dataclass(frozen=True)
class MicroTime:
    """One micro-batch on one pipeline rank: its compute and the communication on its critical path (seconds), and the
    bytes that communication hands to collectives."""

    compute: float
    tp: float
    p2p: float
    ep: float
    ring: float
    tp_bytes: float
    p2p_bytes: float
    ep_bytes: float

    @property
    def seconds(self) -> float:
        return self.compute + self.tp + self.p2p + self.ep + self.ring


def _micro_seconds(
    hardware: HardwareProfile, profile: ModelProfile, step: StepProfile, layout: Layout, workload: Workload,
    stages: list[list[str]], flops: float, micro: float, processes: int,
) -> MicroTime:
    """One micro-batch on the pipeline rank running ``stages`` (``flops`` per sample) while ``processes`` of the node
    run at once (``hardware`` as they share it: :meth:`HardwareProfile.sharing_node`)."""
    segments = [segment for stage in stages for segment in stage]
    share = 1.0 if layout.pp == 1 else _trunk_share(profile, segments)
    tokens = 1.0 / layout.cp  # context parallelism: each rank runs 1/cp of every sample's tokens
    compute = _compute_seconds(hardware, step, segments, flops, micro * tokens, share, processes)
    if layout.pp > 1 and step.tp_bytes_by_segment:  # each stage's own traffic (embeddings, head included)
        tp_b = sum(step.tp_bytes_by_segment.get(s, 0.0) for s in segments) * micro * tokens
    else:
        tp_b = step.tp_bytes * micro * share * tokens
    # The tp ranks of a layer run the same operators between its collectives: they meet each one together.
    tp_calls = step.tp_collectives * share
    tp_t = _collective_seconds(hardware, layout.tp, tp_b, tp_calls, _tp_crosses(layout, workload), "all_reduce",
                               meeting="lockstep", between_s=compute / tp_calls if tp_calls else None)
    # A stage boundary carries this rank's part of the sequence (1/cp of each sample's activations).
    p2p_b = _boundary_bytes(profile, stages) * micro * tokens if layout.pp > 1 else 0.0
    p2p_t = _transfer_seconds(hardware, p2p_b, _pp_crosses(layout, workload)) if layout.pp > 1 else 0.0
    ep_b = _all_to_all_bytes(step, layout) * micro * tokens * share  # this stage's share of the MoE layers
    ep_t = _all_to_all_seconds(hardware, layout, ep_b, step.expert_calls * share, _dp_crosses(layout, workload))
    ring_t = _ring_seconds(hardware, profile, layout, workload, micro, share)
    ring_t += _collective_seconds(hardware, layout.cp, _output_gather_bytes(profile, layout, stages, micro) * layout.cp, 1,
                                  layout.cp * layout.tp > workload.devices_per_node, "all_gather")
    return MicroTime(compute, tp_t, p2p_t, ep_t, ring_t, tp_b, p2p_b, ep_b)


def pipeline_slots(pp: int, microbatches: int, stages_per_rank: int = 1) -> list[int]:
    """Pipeline ranks computing at once in each slot of a forward (or backward) sweep of a GPipe / 1F1B batch.

    A slot is one stage's work on one micro-batch (1/v of a rank's, with v stages per rank); the sweep lasts
    v·m + p − 1 slots, of which the first and last p − 1 (the warm-up and cool-down: the bubble) run fewer than p
    ranks: 1, 2, …, p − 1 filling, p − 1, …, 1 draining. Every rank computes v·m slots: sum(slots) = p·v·m.
    """
    chunks = stages_per_rank * microbatches
    length = chunks + pp - 1
    return [min(k + 1, pp, chunks, length - k) for k in range(length)]


def computing_processes(layout: Layout, processes: int, cores: int) -> list[int]:
    """Processes of the node computing at once in each slot of :func:`pipeline_slots` (``processes`` on the node,
    spread evenly over the pipeline ranks), counted as at least as many as the node's ``cores`` (or all
    ``processes``, fewer): a process's threads are set for the whole job (Lightning's launchers give each
    cores // processes), so one computing with idle cores beside it is no faster than one with a core of its own."""
    floor = min(processes, cores)
    slots = pipeline_slots(layout.pp, layout.microbatches, layout.stages_per_rank)
    return [max(floor, math.ceil(processes * ranks / layout.pp)) for ranks in slots]


def rank_slots(layout: Layout, counts: list[int], pp_rank: int) -> list[int]:
    """Of the per-slot ``counts`` (:func:`computing_processes`), those of the slots where pipeline rank ``pp_rank``
    computes: v·m slots from its ``pp_rank``-th in the forward sweep (the backward sweep's, mirrored, see the same
    counts; an interleaved rank's slots are spread, taken as contiguous)."""
    return counts[pp_rank:pp_rank + layout.stages_per_rank * layout.microbatches]


def pipelined_batch_seconds(layout: Layout, counts: list[int], micro_seconds: float, at_once: dict[int, float]) -> float:
    """One batch through the pipeline: each slot of the schedule takes the slowest rank's micro-batch time (over v)
    as fast as the processes computing in that slot run (``counts``: processes computing at once per slot,
    :func:`computing_processes`; ``at_once``: such a count -> the micro-batch's time then; ``micro_seconds``: with
    every process computing, the steady state).

    Where every process has a core of its own the times are equal and this is m · T / (1 − bubble). On a node whose
    processes outnumber its cores the warm-up and cool-down, which compute on fewer processes, run faster than the
    steady state. Schedules that fill part of the bubble (zero-bubble, DualPipeV) keep their remaining share of it,
    at the same speed-up.
    """
    v, m = layout.stages_per_rank, layout.microbatches
    steady = m * micro_seconds
    plain_bubble = (layout.pp - 1) * micro_seconds / v  # what the slots beyond the steady state's m cost, all computing
    bubble = steady / (1 - bubble_fraction(layout.schedule, layout.pp, m, v)) - steady
    if plain_bubble <= 0:
        return steady + bubble
    slots = sum(at_once[n] for n in counts) / v
    return steady + bubble * (slots - steady) / plain_bubble


def _optimizer_seconds(
    hardware: HardwareProfile, step: StepProfile, names: set[str], parts: int, processes: int, sharded: bool
) -> float:
    """One rank's optimizer step over the parameters ``names``, each held as 1/``parts`` (sharded, or divided
    experts): the operators per tensor it dispatches (on DTensors where the parameters are, or are ``sharded``) and
    the bytes they move. 0 without a measured host (on a GPU the step is a few kernels beside the batches)."""
    if hardware.memory_gbps is None or not names:
        return 0.0
    dtensors = sum(1 for n in names if sharded or n in step.dtensor_parameters)
    ops = step.optimizer_ops_per_tensor
    host = ops * (dtensors * hardware.optimizer_op_seconds(processes, True) + (len(names) - dtensors) * hardware.optimizer_op_seconds(processes, False))
    moved = step.optimizer_moved_per_byte * sum(step.parameter_bytes[n] for n in names) / parts
    return host + moved / hardware.memory_bytes_per_second(processes)


def _stages_by_pipeline_rank(profile: ModelProfile, layout: Layout) -> list[list[list[str]]]:
    """Each pipeline rank's stages, as lists of segments (placed as the schedule places them)."""
    layers = list(profile.trunk_layers)
    if layout.pp == 1:
        return [[list(profile.segments)]]
    from lightning_parallel.parallelize.pipeline.schedule import SCHEDULES, stage_ranks

    num_stages = layout.pp * layout.stages_per_rank
    bounds = [0, *profile.split_points(num_stages), len(layers)]
    stages = [layers[a:b] for a, b in pairwise(bounds)]
    stages[0] = [BEFORE, *stages[0]]
    stages[-1] = [*stages[-1], AFTER]
    owners = stage_ranks(SCHEDULES[layout.schedule], layout.pp, num_stages)
    by_rank: list[list[list[str]]] = [[] for _ in range(layout.pp)]
    for stage, rank in zip(stages, owners):
        by_rank[rank].append(stage)
    return by_rank


def _parameters_of(step: StepProfile, segments: list[str]) -> set[str]:
    return {name for segment in segments for name in step.segment_parameters.get(segment, ())} | _unused_owned(step, segments)


def _unused_owned(step: StepProfile, segments: list[str]) -> set[str]:
    """Parameters no segment used in the step (frozen branches): held where their module sits."""
    used = {name for names in step.segment_parameters.values() for name in names}
    unused = set(step.parameter_bytes) - used
    layers = [s for s in segments if s not in (BEFORE, AFTER)]
    owned = {n for n in unused if any(n.startswith(layer + ".") for layer in layers)}
    if BEFORE in segments:
        owned |= {n for n in unused if not any(n.startswith(f"{s}.") for s in step.segment_parameters if s not in (BEFORE, AFTER))}
    return owned


def _trunk_share(profile: ModelProfile, segments: list[str]) -> float:
    layers = [s for s in segments if s not in (BEFORE, AFTER)]
    return len(layers) / max(len(profile.trunk_layers), 1)


def _activation_bytes(profile: ModelProfile, step: StepProfile, segments: list[str], checkpointing: bool) -> float:
    """Bytes per sample saved for backward by one micro-batch on these segments."""
    if not checkpointing:
        return sum(step.activation_bytes[s] for s in segments)
    layers = [s for s in segments if s not in (BEFORE, AFTER)]
    kept = sum(profile.layer_input_bytes[s] for s in layers)
    outside = sum(step.activation_bytes[s] for s in segments if s in (BEFORE, AFTER))
    return kept + outside


def _transient_bytes(profile: ModelProfile, step: StepProfile, segments: list[str], layout: Layout, micro: float, shards: int) -> float:
    layers = [s for s in segments if s not in (BEFORE, AFTER)]
    extra = 0.0
    if layout.activation_checkpointing and layers:  # one layer's activations rebuilt during its backward
        extra += max(step.activation_bytes[s] for s in layers) * micro
    if layout.uses_ddp and not layout.gradient_as_bucket_view:
        # DDP's buckets: a second copy of every gradient it synchronises (divided experts are not among them),
        # allocated when it wraps the model and kept.
        synchronised = _parameters_of(step, segments) - step.frozen - (step.expert_parameters if layout.ep > 1 else set())
        extra += sum(step.parameter_bytes[n] for n in synchronised)
    if shards > 1 and layout.pp > 1:  # the stage gathered whole for the step, and its whole gradients accumulating
        whole = sum(step.parameter_bytes[n] for n in _parameters_of(step, segments))
        extra += whole * (shards - 1) / shards + whole
    elif _uses_fsdp(layout) and layers:
        divided = step.expert_parameters if layout.ep > 1 else frozenset()  # FSDP2 leaves divided experts alone
        extra += _fsdp_backward_bytes(max(sum(step.parameter_bytes[n] for n in step.segment_parameters.get(s, ()) if n not in divided)
                                          for s in layers), shards)
    return extra


def _fsdp_backward_bytes(layer: float, shards: int) -> float:
    """What FSDP2 holds beside the sharded state in the backward of a layer of ``layer`` bytes (whole), at its
    fullest (measured with torch's ``FSDPMemTracker``, 2 and 4 shards):

    - the layer's parameters, whole: copied out of the all-gather into tensors of their own, beside the shard;
    - the next layer's all-gather output, prefetched;
    - the layer's whole gradients;
    - the previous layer's reduce-scatter input, a copy of its whole gradients held until the collective completes;

    less the gradient shards of the layer and the previous one, which do not exist yet. With one shard (TP's DTensor
    parameters replicated over dp by FSDP2) the copies are made all the same.
    """
    return 4 * layer - 2 * layer / shards


def _optimizer_step_bytes(
    step: StepProfile, unsplit: StepProfile, layout: Layout, dense: set[str], experts: set[str], shards: int
) -> float:
    """What a pipeline position holds beside its state while the optimizer steps: the optimizer's temporaries (measured
    per byte of the largest tensor it steps, as this rank holds that tensor: divided experts 1/ep of the ``unsplit``
    one, whatever tp, which leaves them whole) and DDP's buckets, which stay."""
    largest = max([step.parameter_bytes[n] / shards for n in dense] + [unsplit.parameter_bytes[n] / layout.ep for n in experts], default=0.0)
    buckets = 0.0
    if layout.uses_ddp and not layout.gradient_as_bucket_view:
        buckets = sum(step.parameter_bytes[n] for n in dense)
    return step.optimizer_temporaries_per_largest * largest + buckets


def _lookup_backward_bytes(profile: ModelProfile, step: StepProfile, trained: set[str], shards: int) -> float:
    """What the backward of an embedding split over the vocabulary and tied to the head holds beside the state
    (``trained``: the rank's parameters with gradients): the lookup's gradient of this rank's rows
    (:mod:`lightning_parallel.parallelize.tensor.vocabulary`), then their sum with the head's gradient, a new tensor,
    before the head's is freed. An untied table's lookup gradient is the state's own."""
    held = 0.0
    for name in step.vocabulary_lookups & trained:
        if len(profile.parameter_segments.get(name, ())) > 1:  # looked up before the trunk and read by the head after it
            held += 2 * step.parameter_bytes[name] / shards
    return held


def _boundary_bytes(profile: ModelProfile, stages: list[list[str]]) -> float:
    """Bytes per sample a rank sends per micro-batch: each stage's output forward, its input's gradient back."""
    layers = list(profile.trunk_layers)
    sent = 0.0
    for stage in stages:
        trunk = [s for s in stage if s not in (BEFORE, AFTER)]
        first, last = layers.index(trunk[0]), layers.index(trunk[-1])
        if last + 1 < len(layers):
            sent += profile.layer_input_bytes[layers[last + 1]]  # activations to the next stage
        if first > 0:
            sent += profile.layer_input_bytes[trunk[0]]  # their gradient back to the previous one
    return sent


def _ring_factor(ranks: int, kind: str) -> float:
    if ranks <= 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks


def _collective_seconds(
    hardware: HardwareProfile, ranks: int, payload: float, calls: float, crosses: bool, kind: str, meeting: str = "arriving",
    between_s: float | None = None,
) -> float:
    """``calls`` collectives of ``kind`` over ``ranks`` handing them ``payload`` bytes in all (``meeting``: how the ranks
    meet them, ``between_s``: each rank's compute between two of them, ``None``: a step's; see
    :meth:`HardwareProfile.link`)."""
    if ranks <= 1 or payload <= 0:
        return 0.0
    # Ring messages one after another: an all-reduce passes 2(n − 1), an all-gather or reduce-scatter n − 1.
    messages = (2 if kind == "all_reduce" else 1) * (ranks - 1)
    bandwidth, latency = hardware.link(crosses, messages=messages, meeting=meeting, ranks=ranks, between_s=between_s)
    return calls * latency + _ring_factor(ranks, kind) * payload / bandwidth


def _transfer_seconds(hardware: HardwareProfile, payload: float, crosses: bool) -> float:
    """A pipeline rank's sends of one micro-batch (its output forward, its input's gradient back: ``payload`` bytes):
    each meets a stage already waiting for it (in 1F1B's steady state a stage posts its receive before it is due)."""
    bandwidth, latency = hardware.link(crosses, messages=1, meeting="send")
    return 2 * latency + payload / bandwidth


def _data_parallel_seconds(hardware: HardwareProfile, layout: Layout, workload: Workload, gradient_bytes: float) -> tuple[float, float, float]:
    """(seconds, payload, wire bytes) of one optimizer step's data-parallel communication on the busiest rank.

    Context-parallel peers average gradients with the data-parallel replicas (dp × cp ranks)."""
    replicas_and_peers = layout.dp * layout.cp
    if replicas_and_peers == 1:
        return 0.0, 0.0, 0.0
    crosses = _dp_crosses(layout, workload)
    shards = _shard_ranks(layout)
    if shards == 1:
        buckets = max(1, math.ceil(gradient_bytes / DDP_BUCKET_BYTES))
        seconds = _collective_seconds(hardware, replicas_and_peers, gradient_bytes, buckets, crosses, "all_reduce")
        return seconds, gradient_bytes, _ring_factor(replicas_and_peers, "all_reduce") * gradient_bytes
    gathers = _gathers_per_step(layout, workload)
    shard_crosses = crosses if layout.data_parallel_mode == "shard" else False
    gather_s = gathers * _collective_seconds(hardware, shards, gradient_bytes, 1, shard_crosses, "all_gather")
    scatter_s = _collective_seconds(hardware, shards, gradient_bytes, 1, shard_crosses, "reduce_scatter")
    replicas = replicas_and_peers // shards
    replicate_s = _collective_seconds(hardware, replicas, gradient_bytes / shards, 1, crosses, "all_reduce")
    wire = (gathers + 1) * _ring_factor(shards, "all_gather") * gradient_bytes + _ring_factor(replicas, "all_reduce") * gradient_bytes / shards
    return gather_s + scatter_s + replicate_s, gradient_bytes * (gathers + 1), wire


def _gathers_per_step(layout: Layout, workload: Workload) -> int:
    """All-gathers of the parameters per optimizer step under sharding: pipeline stages gather once and keep them
    gathered; otherwise each batch gathers in forward and again in backward (after resharding)."""
    return 1 if layout.pp > 1 else 2 * workload.accumulate


def _all_to_all_bytes(step: StepProfile, layout: Layout) -> float:
    """Bytes per sample a rank hands to expert parallelism's all-to-alls: every (token, choice) pair's hidden
    states out and its expert's result back, forward, and their gradients the same two ways in backward."""
    return 4 * step.expert_pair_bytes if layout.ep > 1 else 0.0


def _all_to_all_seconds(hardware: HardwareProfile, layout: Layout, payload: float, moe_calls: int, crosses: bool) -> float:
    """One micro-batch's all-to-alls: (ep - 1) / ep of the payload leaves the rank; 4 exchanges (each a count
    exchange and a token exchange) per MoE layer call."""
    if layout.ep == 1:
        return 0.0
    bandwidth, latency = hardware.link(crosses, messages=layout.ep - 1)
    return 8 * moe_calls * latency + payload * (layout.ep - 1) / layout.ep / bandwidth


def shard_index_of(layout: Layout, axes: Mapping[str, int]) -> int:
    """A rank's index in the group that shards its replica's state (``axes``: its mesh coordinates, as
    :meth:`~lightning_parallel.layout.ParallelLayout.axis_coordinates` gives them): ``dp_shard`` flattened with
    ``cp`` (cp fastest) where FSDP2 shards over both, 0 where nothing is sharded."""
    if _shard_ranks(layout) == 1:
        return 0
    dp_shard = axes.get("dp_shard", 0) if layout.data_parallel_mode != "replicate" else 0
    return dp_shard * layout.cp + axes.get("cp", 0) if _uses_fsdp(layout) else dp_shard


def _shard_ranks(layout: Layout) -> int:
    """Ranks that shard one replica's state: the data-parallel shard group, times cp where FSDP2 runs (sharded
    modes, or DTensor parameters under TP without pipelines: the engine shards over ``dp_shard × cp``; replicated
    pipeline stages average their gradients instead)."""
    sharded = layout.data_parallel_mode != "replicate"
    return (layout.shard_size if sharded else 1) * (layout.cp if _uses_fsdp(layout) else 1)


def _uses_fsdp(layout: Layout) -> bool:
    """Whether FSDP2 wraps the replicas: sharded modes (under pipelines, each stage's), or DTensor parameters under
    TP without pipelines (which DDP cannot take)."""
    return layout.data_parallel_mode != "replicate" or (layout.tp > 1 and layout.dp * layout.cp > 1 and layout.pp == 1)


def _ring_kv_bytes(profile: ModelProfile, layout: Layout, micro: float, share: float = 1.0) -> float:
    """Keys and values of the whole sequence, all attention layers, one micro-batch: two layer inputs per layer
    split over tp (multi-head attention; grouped-query attention sends its fewer key/value heads: less)."""
    return sum(2 * profile.layer_input_bytes[layer] for layer in profile.trunk_layers) / layout.tp * micro * share


def _ring_bytes(profile: ModelProfile, layout: Layout, micro: float, share: float = 1.0) -> tuple[float, float]:
    """(payload handed to collectives, bytes received) of ring attention per micro-batch on one rank (``share``: the
    part of the trunk's attention layers this rank runs, under pipelines).

    Forward all-gathers this rank's keys/values (payload KV/cp, receives (cp−1)/cp of KV); backward gathers them
    again and passes the key/value gradients round the ring in cp exchanges of KV/cp; checkpointing recomputes
    the forward's gather. Overlap with compute is not counted; the gather of the model's outputs is not included.
    """
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    kv = _ring_kv_bytes(profile, layout, micro, share)
    gathers = 3 if layout.activation_checkpointing else 2
    payload = gathers * kv / cp + kv
    received = (gathers + 1) * kv * (cp - 1) / cp
    return payload, received


def _output_gather_bytes(profile: ModelProfile, layout: Layout, stages: list[list[str]], micro: float) -> float:
    """Bytes one rank hands to context parallelism's gather of the model call's outputs per micro-batch: its part of
    the logits (1/cp), gathered whole on every cp rank by the rank that computes the end of the model (the last
    pipeline stage). Its backward hands each rank its slice of the output gradient: no exchange."""
    if layout.cp == 1 or not any(AFTER in stage for stage in stages):
        return 0.0
    return profile.output_bytes * micro / layout.cp


def _ring_seconds(
    hardware: HardwareProfile, profile: ModelProfile, layout: Layout, workload: Workload, micro: float, share: float = 1.0,
) -> float:
    """One micro-batch's ring-attention communication on one rank (no overlap with compute counted)."""
    if layout.cp == 1:
        return 0.0
    calls = (3 if layout.activation_checkpointing else 2) + layout.cp
    bandwidth, latency = hardware.link(layout.cp * layout.tp > workload.devices_per_node, messages=1)
    return len(profile.trunk_layers) * share * calls * latency + _ring_bytes(profile, layout, micro, share)[1] / bandwidth


def _tp_crosses(layout: Layout, workload: Workload) -> bool:
    return layout.tp > workload.devices_per_node


def _dp_crosses(layout: Layout, workload: Workload) -> bool:
    return layout.dp * layout.cp * layout.tp > workload.devices_per_node


def _pp_crosses(layout: Layout, workload: Workload) -> bool:
    return layout.pp > 1 and layout.world_size > workload.devices_per_node


#: torch's DistributedDataParallel.broadcast_bucket_size (torch 2.13): the flat buffer of its initial broadcast.
_DDP_BROADCAST_BUCKET = 250 * 2**20


def _setup_bytes(step: StepProfile, local_parameters: float, layout: Layout, workload: Workload) -> float:
    """Device bytes a rank holds while the model is set up: its part, or (a pipeline built eagerly) the whole model.

    A module built on the meta device, or split by TP / FSDP2 on the host before it moves, puts only this
    rank's part on the device (the host holds one layer at a time while it is initialised); a pipeline is
    cut on the first batch, with the whole module on the device until then unless it was built on meta.
    """
    if layout.pp > 1 and not workload.empty_init:
        return float(sum(step.parameter_bytes.values()))
    if layout.uses_ddp:
        # DDP's constructor broadcasts rank 0's parameters (frozen ones too) through flat buckets of up to 250 MiB:
        # one bucket beside the parameters. Hidden under the training state when everything trains; the peak of a
        # LoRA run, whose frozen base has no gradients or optimizer state.
        return local_parameters + min(float(_DDP_BROADCAST_BUCKET), local_parameters)
    return local_parameters


def _notes(layout: Layout, workload: Workload, hardware: HardwareProfile) -> list[str]:
    notes = []
    if layout.uses_ddp and not layout.gradient_as_bucket_view:
        notes.append("DDP keeps a second copy of the gradients in its buckets: gradient_as_bucket_view=true saves it")
    if layout.pp > 1 and not workload.empty_init:
        notes.append("every rank holds the whole model until the first batch cuts the pipeline: build it with empty_init=true")
    if layout.tp > 1 and _tp_crosses(layout, workload):
        notes.append(f"tp={layout.tp} spans nodes: its all-reduces run at {hardware.inter_node_gbps:g} GB/s instead of {hardware.intra_node_gbps:g}")
    return notes
