"""Hardware profiles: what one device can hold and compute, and how fast its links are.

A profile is a YAML file in ``lightning_parallel/conf/hardware/`` (selected with ``hardware=<name>``, like any Hydra group).
Bandwidths are per device, in the direction data flows (an all-reduce's wire bytes divide by them).
No torch here (a ``measured: true`` profile imports the measuring code when it is loaded).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from itertools import pairwise
from typing import Any

from lightning_parallel.plan.dtypes import DTYPES as DTYPES  # re-exported: callers import it from here

GIB = 2**30
#: How ranks meet a collective inside a node -> the profile field with its fixed cost (see HardwareProfile.link).
_MEETINGS = {"arriving": "intra_node_latency_us", "lockstep": "lockstep_latency_us", "send": "send_latency_us"}


@dataclass(frozen=True)
class HardwareProfile:
    """One kind of device and the network between devices.

    Args:
        name: Short name (the YAML file's name).
        device_memory_gib: Memory of one device usable for training.
        peak_tflops: Dense peak of one device in the training dtype, TFLOP/s.
        achievable_fraction: Share of the peak real training reaches (model FLOPs utilization, 0–1].
        devices_per_node: Devices in one node (tensor parallelism should stay inside one).
        intra_node_gbps: Per-device bandwidth between devices of one node, GB/s (NVLink, or shared memory).
        inter_node_gbps: Per-device bandwidth between nodes, GB/s (InfiniBand, Ethernet).
        intra_node_latency_us: Fixed cost of one collective inside a node, microseconds.
        inter_node_latency_us: Fixed cost of one collective across nodes, microseconds.
        lockstep_latency_us: Fixed cost of one collective inside a node whose ranks arrive together (the previous
            collective lined them up and the same operators ran between: tensor parallelism's), microseconds;
            ``None``: ``intra_node_latency_us``, which is for ranks arriving from compute of their own (a gradient
            synchronization). Measured on CPUs (``measured: true``).
        send_latency_us: Fixed cost of one point-to-point send inside a node to a rank already waiting in its receive
            (a pipeline stage's output or gradient), microseconds; ``None``: ``intra_node_latency_us``. Measured on
            CPUs.
        memory_reserve_fraction: Device memory held back for allocator fragmentation, workspaces and buffers.
        node_tflops: Compute of a whole node shared by its processes (CPU cores); ``None`` when every device
            computes on its own (GPUs). Each process then gets ``node_tflops / processes on the node``, at most
            ``peak_tflops``.
        peak_dtype: The dtype ``peak_tflops`` is for (``bf16``, ``fp16``, ``fp32``, ``fp64``).
        peak_tflops_by_dtype: Dense peaks of other dtypes, TFLOP/s (MFU divides by the training dtype's).
        measured_peak: MFU divides by this run's own matmul benchmark (a CPU) instead of ``peak_tflops``.
        measured: The figures are this machine's (:mod:`lightning_parallel.measure.hardware`): compute peaks,
            collective bandwidth and latency, memory (the host's RAM over ``devices_per_node``), measured once and
            cached; keys the profile gives itself win. In a profile's file, ``measured: auto`` (``hardware=auto``)
            stands for whatever this machine is (:mod:`lightning_parallel.plan.auto_hardware`): ``cpu_local`` on a
            CPU, the GPUs and NCCL measured on a GPU node.
        dtensor_op_us: Host time one DTensor operator costs beyond its kernel (sharding propagation, wrapping),
            microseconds: added per operator a tensor-parallel step dispatches. Measured on CPUs (``measured: true``);
            0 where not measured (a GPU's host work overlaps its kernels).
        host_cores: Cores that the node's processes share for that host work (0: one per process).
        op_us: Host time of one plain operator of forward or backward (dispatch and autograd), microseconds; 0
            where not measured.
        optimizer_op_us: Host time of one operator of the optimizer step on plain tensors (no autograd),
            microseconds; 0 where not measured.
        optimizer_dtensor_op_us: The same on DTensor parameters (tensor parallelism, sharded data parallelism).
        memory_gbps: Bytes per second (GB/s) the operators that are not matmuls move for one process alone. Given
            (measured on CPUs), the step time is a roofline: matmul FLOPs at the peak, the other operators' bytes at
            this bandwidth, and every operator's host time (``achievable_fraction`` then stays 1). ``None``: FLOPs
            at ``achievable_fraction`` of the peak (datasheet profiles).
        node_memory_gbps: That bandwidth for the whole node, shared by its processes like ``node_tflops``.
        matmul_efficiency: Kind of FLOP-counted operator (``matmul/<size>``, ``attention/<head size>``, see
            :func:`lightning_parallel.measure.dispatch.matmul_kind`) -> throughput relative to the peak (measured with
            ``memory_gbps``).
        sharing_processes: Processes the node runs (set by :meth:`sharing_node` for one layout's prediction).
        crowded_latency_us: Processes on the node (more than ``host_cores``) -> fixed cost of one collective among
            them, microseconds: a rank blocked in a collective waits until every peer has been scheduled again.
            Measured on CPUs (``measured: true``); empty where every process has a core of its own.
        crowded_group_latency_us: Processes on the node (more than ``host_cores``) -> ranks of a group -> points
            ``(compute between, all-reduce)``, microseconds: a small all-reduce within each group, every group at
            once, each rank arriving from that much compute of its own (the wall time it took on the time-sliced
            cores). A group's collectives cost this where given (see :meth:`crowded_collective_us`); measured on
            CPUs (``measured: true``).
        crowded_node_tflops: Processes on the node (more than ``host_cores``) -> the node's compute they get together,
            TFLOP/s (as ``node_tflops``, which is for ``host_cores`` processes): time slices, cache refills and
            switches cost a crowded node part of its throughput. Between the counts given it is interpolated, past the
            last it stays the last. Measured on CPUs (``measured: true``).
        crowded_node_memory_gbps: The same for ``node_memory_gbps``.
        pipeline_runtime_bytes: Memory the pipeline's tracing runtime keeps in each process for the run (torch.export,
            FX graphs: tens of MiB whatever the model), counted beside a pipeline rank's tensors where the device's
            memory is the host's. Measured on CPUs (``measured: true``,
            :mod:`lightning_parallel.measure.runtime_memory`); 0 on GPUs, whose memory it does not touch.
        training_runtime_bytes: The same for what any training process allocates in its first steps (the
            autograd engine, operator caches, Lightning's loop: about a MiB whatever the model), counted beside every
            rank's tensors.
        description: Free text (where the numbers come from).
    """

    name: str
    device_memory_gib: float
    peak_tflops: float
    achievable_fraction: float
    devices_per_node: int
    intra_node_gbps: float
    inter_node_gbps: float
    intra_node_latency_us: float = 5.0
    inter_node_latency_us: float = 20.0
    lockstep_latency_us: float | None = None
    send_latency_us: float | None = None
    memory_reserve_fraction: float = 0.1
    node_tflops: float | None = None
    peak_dtype: str = "bf16"
    peak_tflops_by_dtype: Mapping[str, float] | None = None
    measured_peak: bool = False
    measured: bool = False
    dtensor_op_us: float = 0.0
    host_cores: int = 0
    crowded_latency_us: Mapping[int, float] | None = None
    crowded_group_latency_us: Mapping[int, Mapping[int, Sequence[Sequence[float]]]] | None = None
    op_us: float = 0.0
    memory_gbps: float | None = None
    node_memory_gbps: float | None = None
    matmul_efficiency: Mapping[str, float] | None = None
    sharing_processes: int = 1
    optimizer_op_us: float = 0.0
    optimizer_dtensor_op_us: float = 0.0
    pipeline_runtime_bytes: float = 0.0
    training_runtime_bytes: float = 0.0
    crowded_node_tflops: Mapping[int, float] | None = None
    crowded_node_memory_gbps: Mapping[int, float] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        positive = ("device_memory_gib", "peak_tflops", "achievable_fraction", "intra_node_gbps", "inter_node_gbps")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"hardware.{name}={value!r} must be a positive number.")
        if self.achievable_fraction > 1:
            raise ValueError(f"hardware.achievable_fraction={self.achievable_fraction} must be at most 1 (a share of the peak).")
        if isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ValueError(f"hardware.devices_per_node={self.devices_per_node!r} must be a positive int.")
        if not 0 <= self.memory_reserve_fraction < 1:
            raise ValueError(f"hardware.memory_reserve_fraction={self.memory_reserve_fraction} must be in [0, 1).")
        for name in ("memory_gbps", "node_memory_gbps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"hardware.{name}={value!r} must be a positive number (or null).")
        for name in ("lockstep_latency_us", "send_latency_us"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"hardware.{name}={value!r} must be a number of microseconds, 0 or more (or null: "
                                 f"intra_node_latency_us).")
        for processes, groups in (self.crowded_group_latency_us or {}).items():
            for ranks, points in groups.items():
                if not points or any(len(point) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in point) for point in points):
                    raise ValueError(f"hardware.crowded_group_latency_us[{processes}][{ranks}]={points!r} must be "
                                     f"[compute between, all-reduce] pairs of microseconds, 0 or more.")
        if self.node_tflops is not None and self.node_tflops <= 0:
            raise ValueError(f"hardware.node_tflops={self.node_tflops} must be positive (or null for independent devices).")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> HardwareProfile:
        """Build from a mapping (a Hydra node); unknown keys are refused by name."""
        auto = config.get("measured") == "auto"
        if auto:
            from lightning_parallel.plan.auto_hardware import resolve

            config = resolve(config)  # this machine's whole profile: cpu_local's on a CPU, measured GPUs on a GPU node
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known - {"_target_"})
        if unknown:
            raise ValueError(f"hardware profile has unknown key(s) {unknown}; known keys: {sorted(known)}.")
        if config.get("measured") and not auto:
            from lightning_parallel.measure.hardware import measured_profile_fields

            config = {**measured_profile_fields(int(config.get("devices_per_node", 1))), **config}
        required = {"name", "device_memory_gib", "peak_tflops", "achievable_fraction", "devices_per_node",
                    "intra_node_gbps", "inter_node_gbps"}
        missing = sorted(required - set(config))
        if missing:
            raise ValueError(f"hardware profile lacks {missing}; see lightning_parallel/conf/hardware/*.yaml for complete profiles.")
        return cls(**{key: value for key, value in config.items() if key != "_target_"})

    @property
    def usable_memory_bytes(self) -> float:
        """Bytes of one device a layout may plan to fill."""
        return self.device_memory_gib * GIB * (1 - self.memory_reserve_fraction)

    def flops_per_device(self, processes_on_node: int) -> float:
        """Achievable FLOP/s of one process when ``processes_on_node`` share a node."""
        peak = self.peak_tflops
        if self.node_tflops is not None and processes_on_node > 1:  # alone, a process has the whole node
            node = self._crowded(self.node_tflops, self.crowded_node_tflops, processes_on_node)
            peak = min(peak, node / processes_on_node)
        return peak * 1e12 * self.achievable_fraction

    def matmul_flops_per_device(self, processes_on_node: int) -> float:
        """Matmul FLOP/s of one process when ``processes_on_node`` share a node: the peak (no achievable fraction:
        with ``memory_gbps`` the step's other costs are counted, not folded into a fraction)."""
        return self.flops_per_device(processes_on_node) / self.achievable_fraction

    def matmul_slowdown(self, flops_by_kind: Mapping[str, float]) -> float:
        """How much longer a step's FLOP-counted operators take than at the peak: their FLOPs by kind over the
        measured efficiency of each kind (1 where none was measured)."""
        total = sum(flops_by_kind.values())
        if not self.matmul_efficiency or total <= 0:
            return 1.0
        return sum(flops / self.matmul_efficiency.get(kind, 1.0) for kind, flops in flops_by_kind.items()) / total

    def memory_bytes_per_second(self, processes_on_node: int) -> float:
        """Bytes per second the non-matmul operators of one process move when ``processes_on_node`` share a node."""
        if self.memory_gbps is None:
            raise ValueError(f"hardware {self.name!r} has no memory_gbps (a datasheet profile: FLOPs only).")
        bandwidth = self.memory_gbps
        if self.node_memory_gbps is not None and processes_on_node > 1:
            node = self._crowded(self.node_memory_gbps, self.crowded_node_memory_gbps, processes_on_node)
            bandwidth = min(bandwidth, node / processes_on_node)
        return bandwidth * 1e9

    def _crowded(self, node: float, crowded: Mapping[int, float] | None, processes_on_node: int) -> float:
        """A node figure (``node`` for ``host_cores`` processes) for ``processes_on_node``: interpolated between the
        crowded counts measured, the last one's past them."""
        if not crowded or not self.host_cores or processes_on_node <= self.host_cores:
            return node
        return _interpolate(list({self.host_cores: node, **{int(n): value for n, value in crowded.items()}}.items()), processes_on_node)

    def _crowding(self, processes_on_node: int) -> float:
        return max(1.0, processes_on_node / self.host_cores) if self.host_cores else 1.0

    def op_seconds(self, processes_on_node: int) -> float:
        """Host seconds of one plain operator for one of ``processes_on_node`` processes."""
        return self.op_us * 1e-6 * self._crowding(processes_on_node)

    def dtensor_op_seconds(self, processes_on_node: int) -> float:
        """Host seconds of one DTensor operator for one of ``processes_on_node`` processes (slower when they
        outnumber the cores they share)."""
        return self.dtensor_op_us * 1e-6 * self._crowding(processes_on_node)

    def optimizer_op_seconds(self, processes_on_node: int, dtensor: bool) -> float:
        """Host seconds of one optimizer operator (on a DTensor parameter if ``dtensor``) for one of
        ``processes_on_node`` processes."""
        return (self.optimizer_dtensor_op_us if dtensor else self.optimizer_op_us) * 1e-6 * self._crowding(processes_on_node)

    def peak_flops(self, dtype: str, processes_on_node: int) -> float:
        """Dense peak FLOP/s of one process in ``dtype`` when ``processes_on_node`` share a node (what MFU divides by).

        Raises:
            ValueError: The profile gives no peak for ``dtype`` (dividing by another dtype's would be wrong).
        """
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {list(DTYPES)}.")
        if self.measured_peak:
            from lightning_parallel.measure.peak import measured_matmul_tflops

            per_process = measured_matmul_tflops(dtype)
            cores = os.cpu_count() or 1
            return min(per_process, per_process * cores / max(1, processes_on_node)) * 1e12
        peaks = {self.peak_dtype: self.peak_tflops, **(self.peak_tflops_by_dtype or {})}
        if dtype not in peaks:
            raise ValueError(
                f"hardware {self.name!r} gives a peak for {sorted(peaks)} but training runs in {dtype}: add "
                f"peak_tflops_by_dtype.{dtype} to its profile (MFU against another dtype's peak would be wrong)."
            )
        peak = peaks[dtype]
        if self.node_tflops is not None:
            peak = min(peak, self.node_tflops * peak / self.peak_tflops / max(1, processes_on_node))
        return peak * 1e12

    def link(
        self, crosses_nodes: bool, messages: int | None = None, meeting: str = "arriving", ranks: int | None = None,
        between_s: float | None = None,
    ) -> tuple[float, float]:
        """(bytes per second, seconds of latency) of the links a group uses, for a collective that passes ``messages``
        one after another (a ring all-reduce over n ranks: 2(n − 1); a send: 1). They count only where the node's
        processes outnumber its cores (:meth:`sharing_node`): each message then waits for its receiver to be
        scheduled again. ``meeting`` says how the ranks meet it inside a node: ``"arriving"`` each from compute of
        its own, ``"lockstep"`` together (``lockstep_latency_us``), ``"send"`` a send to a waiting rank
        (``send_latency_us``). Both of the last assume every rank runs on a core of its own: on a crowded node the
        peers are time-sliced and the waiting rank sleeps, so they cost what ranks arriving apart do. There a
        collective of a group of ``ranks``, with ``between_s`` seconds of compute on each rank since its last one
        (``None``: the compute of a whole step), costs the figure measured for such groups where the profile has it
        (:meth:`crowded_collective_us`)."""
        if crosses_nodes:
            return self.inter_node_gbps * 1e9, self.inter_node_latency_us * 1e-6
        if meeting not in _MEETINGS:
            raise ValueError(f"meeting={meeting!r} is not one of {list(_MEETINGS)}.")
        crowded = bool(messages and self.host_cores and self.sharing_processes > self.host_cores
                       and (self.crowded_latency_us or self.crowded_group_latency_us))
        latency = None if crowded else getattr(self, _MEETINGS[meeting])
        if latency is None:
            latency = self.intra_node_latency_us
        if crowded and meeting != "send" and ranks and ranks > 1 and self.crowded_group_latency_us:
            # Measured for ring all-reduces (2(n − 1) messages): other collectives of the group pass fewer.
            group_us = self.crowded_collective_us(self.sharing_processes, ranks, None if between_s is None else between_s * 1e6)
            return self.intra_node_gbps * 1e9, group_us * messages / (2 * (ranks - 1)) * 1e-6
        if crowded:
            latency = max(latency, messages * self.crowded_message_us(self.sharing_processes))
        return self.intra_node_gbps * 1e9, latency * 1e-6

    def crowded_collective_us(self, processes: int, ranks: int, between_us: float | None) -> float:
        """One small all-reduce among ``ranks`` of ``processes`` sharing the node (more than its cores), each rank
        arriving from ``between_us`` of compute (``None``: more than any measured point), from
        ``crowded_group_latency_us``: linear in the compute between the points measured and flat past them (a peer's
        wait stops growing once the compute outlasts its time slices); per ring message, linear in the group size
        between those measured and flat past them; between the process counts measured linear from the uncrowded
        latency at ``host_cores``, and past the last one growing with the processes each core takes turns with."""
        table = {int(n): groups for n, groups in (self.crowded_group_latency_us or {}).items()}
        if not table:
            raise ValueError(f"hardware {self.name!r} has no crowded_group_latency_us.")

        def at(n: int) -> float:
            per_message = sorted(
                (int(size), _interpolate([tuple(point) for point in points], between_us) / (2 * (int(size) - 1)))
                for size, points in table[n].items()
            )
            return _interpolate(per_message, ranks) * 2 * (ranks - 1)

        counts = sorted(table)
        points = [(self.host_cores, self.intra_node_latency_us)] if self.host_cores and self.host_cores < counts[0] else []
        points += [(n, at(n)) for n in counts]
        if processes > counts[-1]:
            return points[-1][1] * processes / counts[-1]
        return _interpolate(points, processes)

    def sharing_node(self, processes_on_node: int) -> HardwareProfile:
        """This profile as ``processes_on_node`` processes sharing one node see it (their collectives' latency)."""
        return replace(self, sharing_processes=processes_on_node)

    def crowded_message_us(self, processes: int) -> float:
        """One message of a collective when ``processes`` (more than the cores) share the node: the measured
        all-reduce among all of them over its 2(n − 1) ring messages, interpolated between the counts measured (the
        cores' count at the uncrowded latency), extrapolated past the last on the power law of the last two."""
        points = sorted({self.host_cores: self.intra_node_latency_us, **{int(n): us for n, us in (self.crowded_latency_us or {}).items()}}.items())
        per_message = [(n, us / max(2 * (n - 1), 1)) for n, us in points]
        if len(per_message) == 1:
            return per_message[0][1]
        for (n0, us0), (n1, us1) in pairwise(per_message):
            if processes <= n1:
                return us0 + (us1 - us0) * (processes - n0) / (n1 - n0)
        (n0, us0), (n1, us1) = per_message[-2], per_message[-1]
        exponent = math.log(max(us1, 1e-9) / max(us0, 1e-9)) / math.log(n1 / n0)
        return us1 * (processes / n1) ** max(exponent, 0.0)


def _interpolate(points: Sequence[tuple[float, float]], x: float | None) -> float:
    """The value at ``x`` of the (x, value) ``points``, linear between them and flat past either end (``None``: past
    the last)."""
    points = sorted(points)
    if x is None or x >= points[-1][0]:
        return points[-1][1]
    if x <= points[0][0]:
        return points[0][1]
    for (x0, v0), (x1, v1) in pairwise(points):
        if x <= x1:
            return v0 + (v1 - v0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable: x is inside the points")

