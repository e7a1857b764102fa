"""A dry run of one training step on the meta device: what the model holds, computes and saves, per layer.

The LightningModule is built on the meta device (no memory is allocated, nothing is computed) and its
own ``training_step`` runs once on a meta copy of a real batch, then backward and one optimizer step:

- parameter and optimizer-state bytes per parameter (the optimizer the module configures, stepped on meta);
- FLOPs of forward + backward (``torch.utils.flop_counter``), shared out over the model's *segments*: what
  runs before the trunk (embeddings), each trunk layer, what runs after it (head, loss);
- activation bytes saved for backward per segment (autograd's saved-tensor hooks; parameters excluded);
- the bytes of each trunk layer's input (what activation checkpointing keeps, what a pipeline sends).

For each tensor-parallel degree the same step runs again with the strategy's tensor-parallel plan applied
over a fake process group of that size (``torch.testing``'s ``fake`` backend: collectives return at once),
so per-rank shards, per-rank FLOPs and the bytes DTensor's collectives move are those of the real plan.
Figures are per sample of the batch. No Lightning Trainer here.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from lightning_parallel.measure.collectives import DTensorCollectives
from lightning_parallel.measure.dispatch import CpuAttentionKernel, StepOperators, TemporaryPeak
from lightning_parallel.measure.memory import local_bytes, local_rows
from lightning_parallel.parallelize.common.meta_run import without_values
from lightning_parallel.parallelize.common.model_call import capture_model_call
from lightning_parallel.parallelize.pipeline.split import (
    find_trunk,
    layer_costs,
    partition,
    trunk_layer_names,
)
from lightning_parallel.parallelize.tensor.apply import (
    TensorParallelConfig,
    apply_tensor_parallel,
    check_plan,
)
from lightning_parallel.plan.dry_run_errors import named_failures, values_estimated
from lightning_parallel.plan.experts import RoutedTraffic, balanced_routing

BEFORE, AFTER = "(before trunk)", "(after trunk)"


@dataclass(frozen=True)
class StepProfile:
    """One rank's share of a training step at one tensor-parallel degree (figures per sample)."""

    tp: int
    parameter_bytes: dict[str, int]  # canonical parameter name -> bytes on this rank
    optimizer_bytes: dict[str, int]  # canonical parameter name -> optimizer-state bytes on this rank
    flops: dict[str, float]  # segment -> forward + backward FLOPs per sample on this rank
    forward_flops: dict[str, float]  # segment -> forward FLOPs per sample (recomputed under checkpointing)
    activation_bytes: dict[str, float]  # segment -> bytes saved for backward per sample
    tp_bytes: float  # bytes handed to DTensor collectives per sample (forward + backward)
    tp_collectives: int  # DTensor collectives per forward + backward (of any batch size)
    segment_parameters: dict[str, tuple[str, ...]]  # segment -> canonical names of the parameters it uses
    frozen: frozenset[str] = frozenset()  # parameters without gradients (requires_grad=False)
    # segment -> its part of tp_bytes: forward traffic seen while the segment ran, backward shared out alike
    tp_bytes_by_segment: dict[str, float] = field(default_factory=dict)
    # Routed experts (Mixture-of-Experts): their parameters' canonical names, the bytes per sample of the hidden
    # states their (token, choice) pairs carry into them (forward, summed over MoE layers) and their calls per step
    expert_parameters: frozenset[str] = frozenset()
    expert_pair_bytes: float = 0.0
    expert_calls: int = 0
    expert_counts: tuple[int, ...] = ()  # routed experts per MoE layer (distinct counts)
    # segment -> forward FLOPs per sample of its routed experts computed whole (at even load; the same at every tp)
    expert_forward_flops: dict[str, float] = field(default_factory=dict)
    # segment -> bytes per sample the routed experts saved for backward on this rank (split as this profile's tp does)
    expert_activation_bytes: dict[str, float] = field(default_factory=dict)
    # flops / forward_flops / activation_bytes as this rank has them under expert parallelism, where tensor
    # parallelism leaves the experts whole: its tp peers hold the same tokens (replicated over tp) and each runs every
    # pair routed to its experts, so the experts' part is not divided by tp (empty: the same as without ep)
    expert_parallel_flops: dict[str, float] = field(default_factory=dict)
    expert_parallel_forward_flops: dict[str, float] = field(default_factory=dict)
    expert_parallel_activation_bytes: dict[str, float] = field(default_factory=dict)

    def with_whole_experts(self) -> StepProfile:
        """This step as an expert-parallel rank runs it: the routed experts' FLOPs and activations whole over tp."""
        if not self.expert_parallel_flops:
            return self
        return dataclasses.replace(self, flops=self.expert_parallel_flops, forward_flops=self.expert_parallel_forward_flops,
                                   activation_bytes=self.expert_parallel_activation_bytes or self.activation_bytes)
    dtensor_ops: int = 0  # aten operators dispatched on DTensors per forward + backward (of any batch size)
    ops: int = 0  # aten operators dispatched per forward + backward (of any batch size), DTensor ones included
    # segment -> bytes per sample the operators without FLOPs (norms, activations, adds) read and write on this rank
    # (forward + backward; backward shared out as forward is)
    memory_bytes: dict[str, float] = field(default_factory=dict)
    # kind of FLOP-counted operator (measure.dispatch.matmul_kind) -> this rank's FLOPs of it per forward + backward
    matmul_flops_by_kind: dict[str, float] = field(default_factory=dict)
    # The optimizer step (once per optimizer step, on each rank's own parameters): operators per parameter tensor it
    # steps, bytes its operators read and write per parameter byte, and the parameters that are DTensors here
    # (their operators pay DTensor's dispatch)
    optimizer_ops_per_tensor: float = 0.0
    optimizer_moved_per_byte: float = 0.0
    dtensor_parameters: frozenset[str] = frozenset()
    # The most bytes the optimizer step's temporaries hold at once, per byte of the largest parameter tensor it steps
    # (measured on meta, where optimizers choose their per-tensor loop: temporaries of one tensor at a time)
    optimizer_temporaries_per_largest: float = 0.0
    # Weights of embeddings split over the vocabulary here (their lookup's gradient is computed for the rank's rows,
    # and added to a tied head's at the end of backward)
    vocabulary_lookups: frozenset[str] = frozenset()
    # canonical parameter name -> rows (dim 0) of this rank's tensor: FSDP2 shards dim 0 in whole rows
    parameter_rows: dict[str, int] = field(default_factory=dict)

    def shard_bytes(self, sizes: Mapping[str, float], names: Iterable[str], shards: int, index: int = 0) -> float:
        """Bytes of ``sizes`` (per parameter name: this rank's parameter or optimizer-state bytes) for ``names``
        held by FSDP2's shard ``index`` of ``shards``: each tensor is cut along dim 0 into chunks of
        ⌈rows / shards⌉ whole rows (``torch.chunk``), so the first ranks hold whole chunks and the last may hold
        none — a tensor of fewer rows than ranks costs each of the first a whole row, not 1/shards of it.
        Index 0 is the fullest."""
        total = 0.0
        for name in names:
            rows = self.parameter_rows.get(name, 0)
            if not rows:  # not recorded: an even share
                total += sizes.get(name, 0) / shards
                continue
            chunk = math.ceil(rows / shards)
            held = min(chunk, max(0, rows - index * chunk))
            total += sizes.get(name, 0) * held / rows
        return total


@dataclass(frozen=True)
class ModelProfile:
    """What a planner needs to know about a model, from dry runs on the meta device.

    Attributes:
        name: The LightningModule's class name.
        root_name: The module ``training_step`` calls (the one a pipeline cuts), relative to the LightningModule.
        segments: ``(before trunk)``, each trunk layer's name (relative to the LightningModule), ``(after trunk)``.
        parameter_segments: Canonical parameter name -> the segments that use it (a tied weight may be used twice).
        layer_input_bytes: Trunk layer -> bytes per sample of its input (kept by activation checkpointing,
            sent between pipeline stages).
        layer_costs: Parameter counts the pipeline's ``balance="params"`` split weighs the trunk layers by.
        tp_invalid: Tensor-parallel degree -> why the plan cannot use it.
        attention_heads: Head counts found on attention modules (limit tensor parallelism).
        dtype_bytes: Bytes per element of the parameters.
        steps: Per tensor-parallel degree, the step's share per rank.
        output_bytes: Bytes per sample of the model call's sequence-shaped outputs (logits: context parallelism
            gathers them whole on every rank).
        expert_lists: Some MoE block keeps its routed experts as an ``nn.ModuleList`` (which expert parallelism
            divides with fewer layouts).
    """

    name: str
    root_name: str
    segments: tuple[str, ...]
    parameter_segments: dict[str, tuple[str, ...]]
    layer_input_bytes: dict[str, float]
    layer_costs: tuple[float, ...]
    dtype_bytes: int
    steps: dict[int, StepProfile] = field(default_factory=dict)
    tp_invalid: dict[int, str] = field(default_factory=dict)
    expert_lists: bool = False
    output_bytes: float = 0.0

    @property
    def trunk_layers(self) -> tuple[str, ...]:
        return self.segments[1:-1]

    @property
    def experts_divisor(self) -> int:
        """What every expert-parallel size must divide: the greatest common divisor of the MoE layers' routed expert
        counts (0 for a model without routed experts)."""
        return math.gcd(*self.steps[1].expert_counts) if self.steps[1].expert_counts else 0

    @property
    def parameter_count(self) -> int:
        whole = self.steps[1].parameter_bytes
        return sum(whole.values()) // self.dtype_bytes

    def step(self, tp: int) -> StepProfile:
        if tp not in self.steps:
            reason = self.tp_invalid.get(tp, "it was not profiled")
            raise ValueError(f"tensor_parallel_size={tp} cannot be planned for {self.name}: {reason}.")
        return self.steps[tp]

    def split_points(self, num_stages: int) -> list[int]:
        """Index of the first trunk layer of stages 1.. for ``num_stages`` (what ``split_points=auto`` picks)."""
        return partition(self.layer_costs, num_stages)


def profile_model(
    build_module: Callable[[], LightningModule],
    batch: Any,
    tensor_parallel_sizes: tuple[int, ...] = (1,),
    tensor_parallel: TensorParallelConfig | None = None,
    dtype: torch.dtype | None = None,
) -> ModelProfile:
    """Dry-run ``training_step`` on the meta device for each tensor-parallel degree.

    Args:
        build_module: Returns a fresh LightningModule; called under ``torch.device("meta")``.
        batch: One real training batch (moved to the meta device here).
        tensor_parallel_sizes: Degrees to profile; degrees the plan cannot split by land in ``tp_invalid``.
        tensor_parallel: The tensor-parallel plan (default: inferred, as the strategies do).
        dtype: Floating-point type the Trainer trains the parameters in (``precision="64-true"``: float64);
            ``None`` keeps the module's own.

    Raises:
        RuntimeError: A process group already exists in this process (profiling needs its own fake ones).
    """
    if dist.is_initialized() and any(tp > 1 for tp in tensor_parallel_sizes):
        raise RuntimeError(
            "profile_model needs a fake process group per tensor-parallel degree, but this process already has one. "
            "Profile before training starts (or with tensor_parallel_sizes=(1,))."
        )
    config = tensor_parallel if tensor_parallel is not None else TensorParallelConfig()
    meta_batch = tree_map(lambda t: _to_meta(t, dtype) if isinstance(t, Tensor) else t, batch)
    rows = _batch_rows(meta_batch)

    def build() -> LightningModule:
        with _quiet(), torch.device("meta"):
            module = build_module()
        _parameters_on_meta(module)
        return module.to(dtype) if dtype is not None else module

    module = build()
    with (balanced_routing(module) as routed, without_values(), values_estimated(),  # routed experts: at even load
          named_failures(module, "one training step")):
        whole = _dry_run(module, meta_batch, rows, tp=1, routed=routed)
        routed_calls, routed_bytes = routed.calls, routed.pair_bytes  # of the step's one forward
        root_name, segments, parameter_segments, layer_inputs, costs, output_bytes = _structure(module, meta_batch, rows)
    names = _canonical_names(module)
    expert_names = frozenset(names[id(p)] for name, p in module.named_parameters() if name in routed.parameters)
    counts = tuple(sorted(routed.counts))
    expert_flops = whole.expert_forward_flops
    whole = dataclasses.replace(whole, expert_parameters=expert_names, expert_pair_bytes=routed_bytes / rows,
                                expert_calls=routed_calls, expert_counts=counts)
    profile = ModelProfile(
        name=type(module).__name__,
        root_name=root_name,
        segments=segments,
        parameter_segments=parameter_segments,
        layer_input_bytes=layer_inputs,
        layer_costs=costs,
        output_bytes=output_bytes,
        dtype_bytes=next(module.parameters()).element_size(),
        steps={1: whole},
        expert_lists=routed.lists,
    )
    for tp in sorted(set(tensor_parallel_sizes) - {1}):
        module = build()
        try:
            resolved = config.resolve(module, warn=lambda _: None, tp_size=tp)
            check_plan(module, resolved, tp)
        except (ValueError, TypeError) as error:
            profile.tp_invalid[tp] = str(error)
            continue
        if not any(style != "replicate" for style in resolved.styles.values()):
            profile.tp_invalid[tp] = "the tensor-parallel plan splits nothing in this model"
            continue
        try:
            with (_fake_process_group(tp) as mesh, balanced_routing(module) as split_routed, without_values(), values_estimated(),
                  named_failures(module, f"one training step split tensor_parallel_size={tp} ways")):
                apply_tensor_parallel(module, mesh, resolved, sequence_parallel=config.sequence_parallel)
                loss_parallel = any(style == "loss_parallel" for style in resolved.styles.values())
                step = _dry_run(module, meta_batch, rows, tp, loss_parallel, whole=whole, routed=split_routed)
        except (RuntimeError, ValueError, TypeError) as error:
            # The whole step ran: what fails once split is the tensor-parallel plan on this model, which training at
            # this degree would meet too (the strategy's own checks at a call): the degree is unavailable, not the plan.
            profile.tp_invalid[tp] = f"its step split {tp} ways fails ({type(error).__name__}: {error})"
            continue
        profile.steps[tp] = dataclasses.replace(step, expert_parameters=expert_names, expert_pair_bytes=whole.expert_pair_bytes,
                                                expert_calls=routed_calls, expert_counts=counts, expert_forward_flops=expert_flops,
                                                **_experts_whole(whole, step, expert_names, expert_flops))
    return profile


# ---------------------------------------------------------------------------------------------- dry runs


def _dry_run(
    module: LightningModule, batch: Any, rows: int, tp: int, loss_parallel: bool = False, whole: StepProfile | None = None,
    routed: RoutedTraffic | None = None,
) -> StepProfile:
    names = _canonical_names(module)
    tracker = _SegmentTracker(module, batch)
    if routed is not None:  # the routed experts' FLOPs and activations by the segment they ran in
        routed.where, routed.saved = (lambda: tracker.current), (lambda: sum(tracker.saved_bytes.values()))
    collectives = DTensorCollectives()
    dispatches = StepOperators(lambda: tracker.current)
    parallel_loss: Any = nullcontext()
    if loss_parallel:
        from torch.distributed.tensor.parallel import (
            loss_parallel as parallel_loss_context,
        )

        parallel_loss = parallel_loss_context()
    with _quiet(), CpuAttentionKernel(), FlopCounterMode(display=False) as counter, collectives.active(), parallel_loss, dispatches:
        tracker.flop_counter, tracker.collectives = counter, collectives
        with tracker.tracking():
            loss = _loss(module.training_step(batch, 0))
        forward = tracker.forward_flops(counter.get_flop_counts(), counter.get_total_flops())
        expert_flops, expert_saved = tracker.expert_work(routed.flops, rows) if routed is not None else ({}, {})
        tracker._switch(tracker.current)  # close the forward's last segment
        tracker.collectives = None
        forward_memory = dict(dispatches.memory_bytes)
        loss.backward()
    memory = _shared_out(forward_memory, sum(dispatches.memory_bytes.values()), tracker.segments)
    backward_factor = counter.get_total_flops() / max(sum(forward.values()), 1)
    parameter_bytes = {names[id(p)]: local_bytes(p) for p in module.parameters()}
    parameter_rows = {names[id(p)]: local_rows(p) for p in module.parameters()}
    if whole is not None:
        # FlopCounterMode counts a DTensor op at its global shape: a rank's share of a segment's FLOPs is
        # taken to be its share of the segment's parameters (matmuls and attention heads split with them).
        forward = {k: v * _local_share(k, whole, parameter_bytes) for k, v in whole.forward_flops.items()}
        forward = {k: v * rows for k, v in forward.items()}
        backward_factor = sum(whole.flops.values()) / max(sum(whole.forward_flops.values()), 1e-30)
    # Backward shares out as forward does (about twice each segment's forward).
    flops = {segment: value * backward_factor for segment, value in forward.items()}
    if whole is None:
        optimizer_bytes, optimizer_ops, optimizer_moved, optimizer_temporaries = _optimizer_step(module, names)
    else:
        optimizer_bytes = _scaled_optimizer_bytes(whole, parameter_bytes)
        optimizer_ops, optimizer_moved = whole.optimizer_ops_per_tensor, whole.optimizer_moved_per_byte
        optimizer_temporaries = whole.optimizer_temporaries_per_largest
    return StepProfile(
        tp=tp,
        parameter_bytes=parameter_bytes,
        parameter_rows=parameter_rows,
        optimizer_bytes=optimizer_bytes,
        flops={k: v / rows for k, v in flops.items()},
        forward_flops={k: v / rows for k, v in forward.items()},
        activation_bytes={k: v / rows for k, v in tracker.saved_bytes.items()},
        tp_bytes=collectives.tally.bytes / rows,
        tp_collectives=collectives.tally.calls,
        dtensor_ops=dispatches.dtensor_ops,
        ops=dispatches.ops,
        memory_bytes={k: v / rows for k, v in memory.items()},
        matmul_flops_by_kind=dict(dispatches.matmul_flops),
        tp_bytes_by_segment={k: v / rows for k, v in tracker.tp_bytes_by_segment(collectives.tally.bytes).items()},
        segment_parameters=tracker.segment_parameters(names),
        frozen=frozenset(names[id(p)] for p in module.parameters() if not p.requires_grad),
        optimizer_ops_per_tensor=optimizer_ops,
        optimizer_moved_per_byte=optimizer_moved,
        optimizer_temporaries_per_largest=optimizer_temporaries,
        expert_forward_flops=expert_flops if whole is None else {},
        expert_activation_bytes=expert_saved,
        dtensor_parameters=frozenset(names[id(p)] for p in module.parameters() if isinstance(p, DTensor)),
        vocabulary_lookups=frozenset(names[id(sub.weight)] for sub in module.modules() if isinstance(sub, nn.Embedding)
                                     and isinstance(sub.weight, DTensor) and any(p.is_shard(0) for p in sub.weight.placements)),
    )


def _structure(
    module: LightningModule, batch: Any, rows: int
) -> tuple[str, tuple[str, ...], dict[str, tuple[str, ...]], dict[str, float], tuple[float, ...], float]:
    """The pipelined module, the segments, which segments use each parameter, layer input sizes, split costs, and
    the model call's output bytes per sample."""
    with _quiet():
        captured = capture_model_call(module, "training_step", (batch, 0), {})
    root = module.get_submodule(captured.name)
    tracker = _SegmentTracker(module, batch)
    outputs: list[float] = []
    recorder = root.register_forward_hook(lambda _, __, output: outputs.append(_sequence_output_bytes(output)))
    try:
        with _quiet(), tracker.tracking(), torch.no_grad():
            module.training_step(batch, 0)
    finally:
        recorder.remove()
    found = _trunk_of(root)
    costs = layer_costs(root, list(found[1].children()), captured.args, captured.kwargs, "params") if found else []
    names = _canonical_names(module)
    used = {names[pid]: tuple(segments) for pid, segments in tracker.parameter_segments.items() if pid in names}
    for name in names.values():  # never used in the step: held by the stage whose module owns it
        used.setdefault(name, (tracker.owner_segment(name),))
    inputs = {layer: nbytes / rows for layer, nbytes in tracker.layer_input_bytes.items()}
    return captured.name, tracker.segments, used, inputs, tuple(costs), (outputs[0] if outputs else 0.0) / rows


def _sequence_output_bytes(output: Any) -> float:
    """Bytes of the model call's floating outputs of two dims or more (logits, hidden states: what context parallelism
    gathers whole over the sequence on every rank)."""
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point() and t.dim() >= 2]
    return float(sum(_local(t).numel() * _local(t).element_size() for t in tensors))


class _SegmentTracker:
    """Forward hooks that know which segment (before the trunk, trunk layer i, after it) is running."""

    def __init__(self, module: LightningModule, batch: Any) -> None:
        self.module = module
        with _quiet():
            captured = capture_model_call(module, "training_step", (batch, 0), {})
        prefix = f"{captured.name}." if captured.name else ""
        found = _trunk_of(module.get_submodule(captured.name))
        # Without a trunk (no layer list to pipeline) the whole step is one segment, "before the trunk".
        self.layer_names = [prefix + name for name in trunk_layer_names(*found)] if found else []
        self.layers = [module.get_submodule(name) for name in self.layer_names]
        self.segments = (BEFORE, *self.layer_names, AFTER)
        self.current = BEFORE
        self.saved_bytes: dict[str, float] = dict.fromkeys(self.segments, 0.0)
        self.parameter_segments: dict[int, list[str]] = {}
        self.layer_input_bytes: dict[str, float] = {}
        self._flops_before_trunk: float | None = None
        #: Set while FLOPs are counted, to read how many ran before the trunk.
        self.flop_counter: FlopCounterMode | None = None
        # Keyed by the storage's address, holding the storage: one freed during the step (a parameter replaced by its
        # split, a temporary) could otherwise hand its address to a new activation, which would then go uncounted.
        self._seen_storages: dict[int, Any] = {}
        self._parameter_storages = {_storage_id(p): _local(p).untyped_storage() for p in module.parameters()}
        #: Set while DTensor collectives are counted: forward bytes per segment (see :meth:`_switch`).
        self.collectives: DTensorCollectives | None = None
        self.forward_tp_bytes: dict[str, float] = dict.fromkeys(self.segments, 0.0)
        self._bytes_at_switch = 0.0

    def owner_segment(self, parameter_name: str) -> str:
        for layer in self.layer_names:
            if parameter_name.startswith(layer + "."):
                return layer
        return BEFORE

    @contextmanager
    def tracking(self) -> Iterator[None]:
        handles = []
        for name, layer in zip(self.layer_names, self.layers):
            handles.append(layer.register_forward_pre_hook(self._enter(name)))
            handles.append(layer.register_forward_hook(self._leave(name)))
        for sub in self.module.modules():
            if sub._parameters:
                handles.append(sub.register_forward_pre_hook(self._uses_parameters))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def segment_parameters(self, names: dict[int, str]) -> dict[str, tuple[str, ...]]:
        """Segment -> canonical names of the parameters it used (after a tracked step)."""
        result: dict[str, list[str]] = {segment: [] for segment in self.segments}
        for pid, segments in self.parameter_segments.items():
            for segment in segments:
                result[segment].append(names[pid])
        return {segment: tuple(found) for segment, found in result.items()}

    def forward_flops(self, counts: Mapping[str, Mapping[Any, int]], forward_total: float) -> dict[str, float]:
        """Forward FLOPs per segment from a FlopCounterMode's per-module counts (taken right after forward)."""
        if not self.layer_names:
            return {BEFORE: float(forward_total), AFTER: 0.0}
        top = type(self.module).__name__
        per_layer = {name: float(sum(counts.get(f"{top}.{name}", {}).values())) for name in self.layer_names}
        before = self._flops_before_trunk or 0.0
        result = {BEFORE: before, **per_layer}
        result[AFTER] = max(0.0, forward_total - before - sum(per_layer.values()))
        return result

    def expert_work(self, calls: list[tuple[str, Any, float, float]], rows: int) -> tuple[dict[str, float], dict[str, float]]:
        """Routed experts' forward FLOPs and saved bytes per sample by segment, counted as :meth:`forward_flops` counts
        them: a call of a module inside a trunk layer (or of a trunk layer itself) is that layer's, any other the
        segment running when it was called (before the trunk, a layer, after it). ``calls``: :attr:`RoutedTraffic.flops`."""
        flops: dict[str, float] = {}
        saved: dict[str, float] = {}
        for fqn, running, value, nbytes in calls:
            segment = next((layer for layer in self.layer_names if fqn == layer or fqn.startswith(layer + ".")), running or BEFORE)
            flops[segment] = flops.get(segment, 0.0) + value / rows
            saved[segment] = saved.get(segment, 0.0) + nbytes / rows
        return flops, saved

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            if name == self.layer_names[0] and self._flops_before_trunk is None:
                self._flops_before_trunk = float(self.flop_counter.get_total_flops()) if self.flop_counter else 0.0
            self._switch(name)
            if name not in self.layer_input_bytes:
                self.layer_input_bytes[name] = float(sum(_local(t).numel() * _local(t).element_size() for t in _tensors(args)))

        return hook

    def _leave(self, name: str) -> Callable[..., None]:
        def hook(_: nn.Module, __: Any, ___: Any) -> None:
            self._switch(AFTER if name == self.layer_names[-1] else name)

        return hook

    def _switch(self, segment: str) -> None:
        """Another segment starts running: the collectives since the last switch were the current one's."""
        if self.collectives is not None:
            total = float(self.collectives.tally.bytes)
            self.forward_tp_bytes[self.current] += total - self._bytes_at_switch
            self._bytes_at_switch = total
        self.current = segment

    def tp_bytes_by_segment(self, total: float) -> dict[str, float]:
        """``total`` (forward and backward) shared out over the segments as their forward traffic is (backward
        mirrors forward: a row-split output's all-reduce is a column-split input's gradient all-reduce)."""
        self._switch(self.current)
        forward = sum(self.forward_tp_bytes.values())
        if forward <= 0:
            return dict.fromkeys(self.segments, 0.0)
        return {segment: total * value / forward for segment, value in self.forward_tp_bytes.items()}

    def _uses_parameters(self, sub: nn.Module, _: Any) -> None:
        for param in sub._parameters.values():
            if param is not None:
                segments = self.parameter_segments.setdefault(id(param), [])
                if self.current not in segments:
                    segments.append(self.current)

    def _pack(self, saved: Tensor) -> Tensor:
        storage = _storage_id(saved)
        if storage not in self._parameter_storages and storage not in self._seen_storages:
            self._seen_storages[storage] = _local(saved).untyped_storage()
            self.saved_bytes[self.current] += _local(saved).untyped_storage().nbytes()
        return saved


# ---------------------------------------------------------------------------------------------- helpers


def _parameters_on_meta(module: nn.Module) -> None:
    """Parameters a model made outside the meta device context (``torch.normal(..., size=...)`` ignores it: DiffLlama's
    lambdas) moved to meta: on the CPU, their gradient would be a copy out of a meta tensor in backward. Tied
    parameters stay tied."""
    moved: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None and not param.is_meta:
                if id(param) not in moved:
                    moved[id(param)] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
                sub._parameters[name] = moved[id(param)]


def _trunk_of(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The module's trunk (its longest layer list), or ``None`` if it has none (then no pipeline split exists)."""
    try:
        return find_trunk(module)
    except ValueError:
        return None


def _optimizer_step(module: LightningModule, names: dict[int, str]) -> tuple[dict[str, int], float, float, float]:
    """One step of the optimizer(s) the module configures, on meta: optimizer-state bytes per parameter, and the
    operators per stepped parameter tensor and bytes moved per stepped parameter byte (its cost, see
    :class:`StepProfile`), and the most bytes its temporaries held at once per byte of the largest stepped tensor."""
    optimizers = _optimizers(module.configure_optimizers())
    for param in module.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    with _quiet():
        for optimizer in optimizers:
            optimizer.step()  # the first step creates the state: the second is what every later step costs
        counter, temporaries = StepOperators(), TemporaryPeak()
        with counter, temporaries:
            for optimizer in optimizers:
                optimizer.step()
    result = dict.fromkeys(names.values(), 0)
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            result[names[id(param)]] += sum(local_bytes(v) for v in state.values() if isinstance(v, Tensor))
    stepped = {id(p): p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"] if p.grad is not None}
    module.zero_grad(set_to_none=True)
    stepped_bytes = sum(local_bytes(p) for p in stepped.values())
    largest = max((local_bytes(p) for p in stepped.values()), default=0)
    return (result, counter.ops / max(len(stepped), 1), sum(counter.memory_bytes.values()) / max(stepped_bytes, 1),
            temporaries.peak / max(largest, 1))


def _shared_out(forward: Mapping[str, float], total: float, segments: tuple[str, ...]) -> dict[str, float]:
    """``total`` (forward and backward) over the segments as ``forward`` is (backward mirrors forward's work)."""
    forward_total = sum(forward.get(s, 0.0) for s in segments)
    if forward_total <= 0:
        return {s: total / len(segments) for s in segments}
    return {s: total * forward.get(s, 0.0) / forward_total for s in segments}


def _experts_whole(
    whole: StepProfile, step: StepProfile, expert_names: frozenset[str], expert_flops: dict[str, float]
) -> dict[str, dict[str, float]]:
    """``expert_parallel_*`` of a tensor-parallel ``step``: each segment's FLOPs other than its routed experts' shared
    by tp as its other parameters are, the experts' whole (expert parallelism leaves them out of the tp plan; the tp
    peers route the same tokens and each computes them all); its activations with the experts' as the whole step
    saved them."""
    if not expert_flops:
        return {}
    split_saved, whole_saved = step.expert_activation_bytes, whole.expert_activation_bytes
    activations = {segment: value - split_saved.get(segment, 0.0) + whole_saved.get(segment, 0.0)
                   for segment, value in step.activation_bytes.items()}
    dense = {name: size for name, size in step.parameter_bytes.items() if name not in expert_names}
    forward = {}
    for segment, value in whole.forward_flops.items():
        routed = expert_flops.get(segment, 0.0)
        names = [n for n in whole.segment_parameters.get(segment, ()) if n not in expert_names]
        total = sum(whole.parameter_bytes[n] for n in names)
        share = sum(dense[n] for n in names) / total if total else 1.0
        forward[segment] = max(value - routed, 0.0) * share + routed
    factor = sum(whole.flops.values()) / max(sum(whole.forward_flops.values()), 1e-30)
    return {"expert_parallel_forward_flops": forward, "expert_parallel_flops": {k: v * factor for k, v in forward.items()},
            "expert_parallel_activation_bytes": activations}


def _local_share(segment: str, whole: StepProfile, local_parameter_bytes: dict[str, int]) -> float:
    """This rank's share of the parameters a segment uses (1 where nothing is split)."""
    names = whole.segment_parameters.get(segment, ())
    total = sum(whole.parameter_bytes[n] for n in names)
    return sum(local_parameter_bytes[n] for n in names) / total if total else 1.0


def _scaled_optimizer_bytes(whole: StepProfile, local_parameter_bytes: dict[str, int]) -> dict[str, int]:
    """Optimizer state of a split parameter: the whole parameter's, in proportion to the local share."""
    return {
        name: round(whole.optimizer_bytes.get(name, 0) * local / max(whole.parameter_bytes[name], 1))
        for name, local in local_parameter_bytes.items()
    }


def _optimizers(configured: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in whatever ``configure_optimizers`` returned (Lightning's accepted forms)."""
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, Mapping):
        return _optimizers(configured["optimizer"])
    if isinstance(configured, (list, tuple)):
        if len(configured) == 2 and isinstance(configured[0], (list, tuple)):
            return _optimizers(configured[0])
        return [o for item in configured for o in _optimizers(item)]
    return []


def _canonical_names(module: nn.Module) -> dict[int, str]:
    """Parameter id -> its first name (a tied weight answers to its first owner, as ``named_parameters`` does)."""
    return {id(param): name for name, param in module.named_parameters()}


def _loss(output: Any) -> Tensor:
    loss = output["loss"] if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise TypeError(f"training_step returned {type(output).__name__}; the planner needs a loss tensor (or a dict with 'loss').")
    return loss


def _to_meta(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    """The batch tensor on meta; floating inputs in the training dtype, as Lightning's precision plugin casts them."""
    if dtype is not None and tensor.is_floating_point():
        return tensor.to("meta", dtype=dtype)
    return tensor.to("meta")


def _local(tensor: Tensor) -> Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _storage_id(tensor: Tensor) -> int:
    return _local(tensor).untyped_storage()._cdata


def _tensors(tree: Any) -> list[Tensor]:
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, Tensor)]


def _batch_rows(batch: Any) -> int:
    tensors = _tensors(batch)
    if not tensors or tensors[0].dim() == 0:
        raise TypeError("The planner needs a batch of tensors with the samples along dimension 0.")
    return tensors[0].shape[0]


@contextmanager
def _fake_process_group(size: int) -> Iterator[Any]:
    """A default process group of ``size`` ranks whose collectives do nothing, and a 1-D mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence what a LightningModule says when run without a Trainer (``self.log`` warnings)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
