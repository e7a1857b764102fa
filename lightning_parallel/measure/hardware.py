"""This machine's compute and collective figures, measured once and cached (what ``measured: true`` profiles use).

Compute: a dense matmul with every core (what one process alone trains on) and with one thread (a process's share
when several share the cores: Lightning gives each ``cores // processes`` threads, at least one), per dtype; alike
the memory bandwidth of the operators that are not matmuls (each the median of three samples spread over the
measurement: :func:`_process_rates`), and the host time of one operator (:mod:`lightning_parallel.measure.dispatch`).
Collectives: two processes of the backend in use (gloo on CPU) time an all-reduce of 4 KiB (latency) and of 8 MiB
(bandwidth, wire bytes per rank per second), each after a little compute and without a barrier, as a step meets
them; a small all-reduce in lockstep (right after the previous one, as tensor parallelism's collectives meet ranks
that run the same operators between them); a small send to a rank already waiting in its receive (half a ping-pong,
as a pipeline stage's output or gradient meets the next stage); and on the same two ranks one DTensor operator's
host overhead
(on a one-rank mesh: no communication in it). Crowded collectives: where a node may run more processes than it has
cores (``CROWDED_PROCESSES``), that many processes time back-to-back small all-reduces. A blocked rank waits until
every peer has been scheduled again, so one collective then costs milliseconds, not microseconds: the figure tensor
parallelism pays per collective when its ranks outnumber the cores. Memory: the host's RAM.

The figures are cached per machine in ``$XDG_CACHE_HOME/lightning_parallel/hardware/`` (default ``~/.cache``),
keyed by host name, core count and torch version; ``LIGHTNING_PARALLEL_MEASURE_HARDWARE=1`` (or
``python -m lightning_parallel.plan --measure-hardware``) measures again.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_parallel import collectives
from lightning_parallel.measure import measurement_cache
from lightning_parallel.measure.dispatch import (
    dtensor_op_seconds,
    matmul_efficiency,
    memory_bytes_per_second,
    memory_step,
    op_seconds,
    optimizer_op_seconds,
)
from lightning_parallel.measure.peak import TORCH_DTYPES, measured_matmul_tflops
from lightning_parallel.measure.runtime_memory import runtime_bytes

#: Dtypes whose matmul peak is measured (the recipes train in fp32, the exactness tests in fp64).
MEASURED_DTYPES = ("fp32", "fp64")
SMALL_BYTES, LARGE_BYTES = 4 * 2**10, 8 * 2**20
#: Process counts whose crowded collective latency is measured, where they outnumber the cores (the planner's
#: local layouts use up to 8 processes per node).
CROWDED_PROCESSES = (4, 8)
#: Matmuls (256 × 512 by 512 × 512, one thread) each rank runs between two collectives of its group on a crowded
#: node: none (back to back), as many as the uncrowded "arriving" benchmark runs, and a layer's worth of several time
#: slices. The planner interpolates at a layout's own compute between collectives (a peer's wait grows with it until
#: the compute outlasts the turns the scheduler gives the processes sharing a core).
CROWDED_GAP_MATMULS = (0, 3, 12)
#: At most this many one-thread processes measure the node's shared figures together; on a bigger host their sum is
#: scaled to every core (each process imports torch: hundreds of MiB apiece).
SHARED_PROCESSES_MAX = 16
#: Seconds the node's processes compute together per measured figure (their common window, after a barrier).
NODE_WORK_SECONDS = 0.6
#: Windows per figure of the node's processes together; the figure is their median.
NODE_WINDOWS = 3
MATMUL_SIZE = 512
_BACKEND = "gloo"  # the CPU processes' backend; GPU profiles stay datasheet-based


@dataclass(frozen=True)
class LocalMeasurements:
    """What was measured on this machine (TFLOP/s, GB/s, microseconds, GiB)."""

    host: str
    cores: int
    torch_version: str
    backend: str
    measured_at: str
    alone_tflops: dict[str, float]  # one process using every core
    per_thread_tflops: dict[str, float]  # one thread
    collective_gbps: float  # wire bytes per rank per second of a large all-reduce between 2 processes
    collective_latency_us: float  # one small all-reduce between 2 processes, each arriving from its own compute
    # one small all-reduce between 2 processes in lockstep (the previous collective lined them up), and one small
    # send to a process already waiting for it; no defaults: a cache written before them is measured again
    lockstep_latency_us: float
    send_latency_us: float
    memory_gib: float  # host RAM
    dtensor_op_us: float  # host time one DTensor operator costs beyond the plain one (measure.dispatch)
    op_us: float  # host time of one plain operator of forward or backward (dispatch and autograd)
    alone_memory_gbps: float  # bytes the non-matmul operators move per second, one process on every core
    per_thread_memory_gbps: float  # the same on one thread
    # one process per core at once, one thread each, the work of all over their common window: what the node's
    # processes get together (shared caches, memory bus and SMT siblings make it less than cores × one thread alone)
    shared_tflops: dict[str, float]
    shared_memory_gbps: float
    matmul_efficiency: dict[str, float]  # matmul/attention kind -> throughput relative to the peak (one thread)
    # processes on the node (more than its cores) -> one small all-reduce among all of them, microseconds; no
    # default: a cache written before it was measured is measured again
    crowded_latency_us: dict[str, float]
    # processes on the node -> group size -> [[compute between, all-reduce], ...] (microseconds, one point per
    # CROWDED_GAP_MATMULS): a small all-reduce among each group of that many ranks, every group at once, each rank
    # arriving from that much compute of its own (the wall time it took, time-sliced); no default, as above
    crowded_group_latency_us: dict[str, dict[str, list[list[float]]]]
    # host time of one operator of an optimizer step (AdamW; no autograd), on plain tensors and on DTensors
    optimizer_op_us: float
    optimizer_dtensor_op_us: float
    # C-allocator bytes the first training steps, and the first pipeline trace besides, add to a process
    # (measure.runtime_memory)
    pipeline_runtime_bytes: float
    training_runtime_bytes: float
    # processes on the node (more than its cores) -> what they compute together, as ``shared_tflops`` (per dtype) and
    # ``memory_gbps``: time slices, cache refills and switches cost the crowded node part of its throughput
    crowded_rates: dict[str, dict[str, float]]

    def describe(self) -> str:
        return (
            f"measured on {self.host} ({self.cores} cores, torch {self.torch_version}) at {self.measured_at}: matmul "
            f"{self.alone_tflops['fp32']:.3g} TFLOP/s fp32 for one process, {self.per_thread_tflops['fp32']:.3g} per thread; "
            f"{self.backend} all-reduce {self.collective_gbps:.3g} GB/s, {self.collective_latency_us:.0f} µs latency "
            f"({self.lockstep_latency_us:.0f} in lockstep), {self.send_latency_us:.0f} µs per send to a waiting rank; "
            f"{self.dtensor_op_us:.0f} µs per DTensor operator, {self.op_us:.1f} µs per operator (optimizer: "
            f"{self.optimizer_dtensor_op_us:.0f} and {self.optimizer_op_us:.1f} µs); non-matmul operators "
            f"{self.alone_memory_gbps:.3g} GB/s for one process, {self.per_thread_memory_gbps:.3g} per thread; "
            f"{self.training_runtime_bytes / 2**20:.0f} MiB of training runtime and "
            f"{self.pipeline_runtime_bytes / 2**20:.0f} MiB of pipeline tracing runtime per process"
            + "".join(f"; {us / 1e3:.1f} ms per all-reduce among {n} processes" for n, us in self.crowded_latency_us.items())
            + "".join(f"; {rates['fp32']:.3g} TFLOP/s fp32 for {n} processes together" for n, rates in self.crowded_rates.items())
        )


def cache_path() -> Path:
    """Where this machine's measurements are kept."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_parallel" / "hardware"
    key = f"{socket.gethostname()}-{os.cpu_count()}cores-torch{torch.__version__}".replace("/", "_").replace("+", "_")
    return root / f"{key}.json"


def local_measurements(remeasure: bool | None = None) -> LocalMeasurements:
    """This machine's figures: from the cache, or measured now (about 30 s) and cached.

    Args:
        remeasure: Measure even if cached (default: whether ``LIGHTNING_PARALLEL_MEASURE_HARDWARE=1``).
    """
    what = f"this machine's compute and {_BACKEND} (about 30 s)"
    return measurement_cache.cached(cache_path(), LocalMeasurements, measure_here, what, remeasure)


def measure_here() -> LocalMeasurements:
    """Measure compute, collectives and memory of this machine now."""
    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    samples = [_process_rates(cores)]
    try:
        torch.set_num_threads(1)
        op_s = op_seconds()
        optimizer_op_s = optimizer_op_seconds()
        efficiency = matmul_efficiency()
    finally:
        torch.set_num_threads(threads)
    collectives = _all_reduce_seconds()
    samples.append(_process_rates(cores))
    crowded_runs = {str(n): _crowded_all_reduce_seconds(n) for n in CROWDED_PROCESSES if n > cores}
    runtime = runtime_bytes()
    samples.append(_process_rates(cores))
    rates = {key: statistics.median(sample[key] for sample in samples) for key in samples[0]}
    alone = {dtype: rates[f"alone/{dtype}"] for dtype in MEASURED_DTYPES}
    per_thread = {dtype: rates[f"thread/{dtype}"] for dtype in MEASURED_DTYPES}
    alone_memory, per_thread_memory = rates["alone/memory"], rates["thread/memory"]
    sharing = min(cores, SHARED_PROCESSES_MAX)
    shared = _node_rates(sharing, cores, per_thread, per_thread_memory)
    scale = cores / sharing
    crowded_rates = {str(n): _node_rates(n, cores, per_thread, per_thread_memory) for n in CROWDED_PROCESSES if n > cores}
    return LocalMeasurements(
        host=socket.gethostname(),
        cores=cores,
        torch_version=torch.__version__,
        backend=_BACKEND,
        measured_at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        alone_tflops=alone,
        per_thread_tflops=per_thread,
        # A 2-rank ring all-reduce puts 2 (n - 1) / n = 1 × the payload on each rank's wire.
        collective_gbps=LARGE_BYTES / max(collectives["large_s"] - collectives["small_s"], 1e-9) / 1e9,
        collective_latency_us=collectives["small_s"] * 1e6,
        lockstep_latency_us=collectives["lockstep_s"] * 1e6,
        send_latency_us=collectives["send_s"] * 1e6,
        memory_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,  # POSIX, as fcntl
        dtensor_op_us=collectives["dtensor_op_s"] * 1e6,
        op_us=op_s * 1e6,
        alone_memory_gbps=alone_memory / 1e9,
        per_thread_memory_gbps=per_thread_memory / 1e9,
        shared_tflops={dtype: scale * shared[dtype] for dtype in MEASURED_DTYPES},
        shared_memory_gbps=scale * shared["memory_gbps"],
        matmul_efficiency=efficiency,
        crowded_latency_us={n: run["seconds"] * 1e6 for n, run in crowded_runs.items()},
        crowded_group_latency_us={n: run["groups_us"] for n, run in crowded_runs.items()},
        optimizer_op_us=optimizer_op_s * 1e6,
        optimizer_dtensor_op_us=collectives["optimizer_dtensor_op_s"] * 1e6,
        pipeline_runtime_bytes=runtime["pipeline"],
        training_runtime_bytes=runtime["training"],
        crowded_rates=crowded_rates,
    )


def _process_rates(cores: int) -> dict[str, float]:
    """One sample of a process's compute and bandwidth: matmul TFLOP/s per dtype with every core (``alone/<dtype>``)
    and with one thread (``thread/<dtype>``), and the non-matmul operators' bytes per second alike (``alone/memory``,
    ``thread/memory``).

    :func:`measure_here` takes three, spread over its whole run (before the collectives, between them and the crowded
    runs, at the end), and keeps each figure's median: a VM's speed moves by a tenth from one second to the next (a
    one-thread matmul read 88, 90 and 100 GFLOP/s on this project's 2-core VM, seconds apart), and a step runs at
    the machine's usual speed, not at its best moment, which the best of three rounds of one sample finds."""
    threads = torch.get_num_threads()
    rates = {}
    try:
        for dtype in MEASURED_DTYPES:
            torch.set_num_threads(cores)
            rates[f"alone/{dtype}"] = _fresh_matmul_tflops(dtype)
            torch.set_num_threads(1)
            rates[f"thread/{dtype}"] = _fresh_matmul_tflops(dtype)
        rates["thread/memory"] = memory_bytes_per_second()
        torch.set_num_threads(cores)
        rates["alone/memory"] = memory_bytes_per_second()
    finally:
        torch.set_num_threads(threads)
    return rates


def _fresh_matmul_tflops(dtype: str) -> float:
    measured_matmul_tflops.cache_clear()  # the cached value is for the caller's thread count
    try:
        return measured_matmul_tflops(dtype)
    finally:
        measured_matmul_tflops.cache_clear()


def _all_reduce_seconds(world_size: int = 2) -> dict[str, float]:
    """Seconds between ``world_size`` gloo processes on this host (means): a small and a large all-reduce each after a
    little compute (``small_s``, ``large_s``), a small one in lockstep (``lockstep_s``), a small send to a waiting
    rank (``send_s``); and on their own meshes one DTensor operator's host overhead (``dtensor_op_s``) and one DTensor
    optimizer operator's host time (``optimizer_dtensor_op_s``)."""
    with tempfile.TemporaryDirectory(prefix="lightning-parallel-hw-") as scratch:
        init = Path(scratch) / "store"
        out = Path(scratch) / "result.json"
        mp.start_processes(_all_reduce_worker, args=(world_size, str(init), str(out)), nprocs=world_size, start_method="spawn")
        return json.loads(out.read_text())


def _all_reduce_worker(rank: int, world_size: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(_BACKEND, init_method=f"file://{init}", rank=rank, world_size=world_size)
    try:
        small = torch.zeros(SMALL_BYTES // 4)
        large = torch.zeros(LARGE_BYTES // 4)
        timings = {}
        # As a training step meets them: each all-reduce after a few milliseconds of compute, with no barrier, so
        # that its ranks arrive as far apart as their compute leaves them and its threads wake from sleep (a
        # barrier before each would time the wire alone: 3-4× less for small messages here). The mean, as a step
        # pays every one.
        a, b = torch.randn(256, 512), torch.randn(512, 512)
        for name, tensor, repeats in (("small_s", small, 30), ("large_s", large, 8)):
            collectives.all_reduce(tensor)  # warm-up (connections, buffers)
            collectives.barrier()
            seconds = []
            for _ in range(repeats):
                for _ in range(3):
                    a @ b
                start = time.perf_counter()
                collectives.all_reduce(tensor)
                seconds.append(time.perf_counter() - start)
            timings[name] = statistics.mean(seconds)
        timings["lockstep_s"] = _lockstep_all_reduce_seconds(small, b)
        timings["send_s"] = _send_to_waiting_seconds(rank, small, b)
        from torch.distributed.device_mesh import DeviceMesh

        # Each rank times DTensor on a mesh of its own: the operators' host work without their communication.
        own = [dist.new_group([r]) for r in range(world_size)][rank]
        collectives.barrier()
        timings["dtensor_op_s"] = dtensor_op_seconds(DeviceMesh.from_group(own, "cpu"))
        timings["optimizer_dtensor_op_s"] = optimizer_op_seconds(DeviceMesh.from_group(own, "cpu"))
        if rank == 0:
            Path(out).write_text(json.dumps(timings))
    finally:
        dist.destroy_process_group()


def _lockstep_all_reduce_seconds(tensor: torch.Tensor, weight: torch.Tensor, repeats: int = 30) -> float:
    """A small all-reduce met in lockstep: the ranks run the same small matmul between collectives, so each arrives as
    its peers do (the previous collective lined them up), as a tensor-parallel layer's collectives meet them."""
    rows = torch.randn(32, weight.shape[0])
    collectives.barrier()
    seconds = []
    for _ in range(repeats):
        rows @ weight
        start = time.perf_counter()
        collectives.all_reduce(tensor)
        seconds.append(time.perf_counter() - start)
    return statistics.mean(seconds)


def _send_to_waiting_seconds(rank: int, tensor: torch.Tensor, weight: torch.Tensor, repeats: int = 30) -> float:
    """A small send to a rank already waiting in its receive, as a pipeline stage's output (or gradient) meets the
    next stage: half of a ping-pong that rank 0 starts after a little compute while rank 1 waits (the mean)."""
    a = torch.randn(256, weight.shape[0])
    collectives.barrier()
    seconds = []
    for _ in range(repeats):
        if rank == 0:
            for _ in range(3):
                a @ weight
            start = time.perf_counter()
            collectives.send(tensor, 1)
            collectives.recv(tensor, 1)
            seconds.append((time.perf_counter() - start) / 2)
        elif rank == 1:
            collectives.recv(tensor, 0)
            collectives.send(tensor, 0)
    collectives.barrier()
    # Only rank 0 timed; every rank returns its figure (rank 0's is the one written).
    return statistics.mean(seconds) if seconds else 0.0


def _node_rates(processes: int, cores: int, per_thread_tflops: dict[str, float], per_thread_memory: float) -> dict[str, float]:
    """What ``processes`` one-thread processes compute together: matmul TFLOP/s per dtype and non-matmul GB/s
    (``memory_gbps``), each the work of all over the window from their common start (a barrier) to the last one's end.

    A fixed amount of work each, sized for about :data:`NODE_WORK_SECONDS` together, not each process's best window:
    where processes outnumber the cores, a short window of one process may fall inside its time slice and measure a
    core of its own, which no step of a training run gets. Each figure is the median of :data:`NODE_WINDOWS` such
    windows: one window of a shared VM moves by 10-30 % between measurements.
    """
    share = min(1.0, cores / processes)  # of a core, per process
    flops = 2 * MATMUL_SIZE**3
    _, moved = memory_step()
    work = {dtype: max(1, round(NODE_WORK_SECONDS * share * rate * 1e12 / flops)) for dtype, rate in per_thread_tflops.items()}
    work["memory_gbps"] = max(1, round(NODE_WORK_SECONDS * share * per_thread_memory / moved))
    with tempfile.TemporaryDirectory(prefix="lightning-parallel-hw-") as scratch:
        mp.start_processes(_node_worker, args=(processes, scratch, work), nprocs=processes, start_method="spawn")
        spans = [json.loads(path.read_text()) for path in sorted(Path(scratch).glob("spans-*.json"))]
    units = {"memory_gbps": moved / 1e9, **{dtype: flops / 1e12 for dtype in per_thread_tflops}}
    rates = {}
    for name, unit in units.items():
        windows = [max(span[name][k][1] for span in spans) - min(span[name][k][0] for span in spans) for k in range(NODE_WINDOWS)]
        rates[name] = processes * work[name] * unit / max(statistics.median(windows), 1e-9)
    return rates


def _node_worker(rank: int, processes: int, scratch: str, work: dict[str, int]) -> None:
    torch.set_num_threads(1)
    runs = {dtype: _matmul_run(dtype) for dtype in work if dtype != "memory_gbps"}
    runs["memory_gbps"] = memory_step()[0]
    # A file store's counter as the barrier (a multiprocessing Barrier's semaphores outlive spawned processes and
    # make the resource tracker warn at exit, on the user's first screen).
    store = dist.FileStore(str(Path(scratch, "barrier")), processes)
    spans: dict[str, list[tuple[float, float]]] = {}
    for name, run in runs.items():
        run()  # warm-up (kernels, pages)
        for window in range(NODE_WINDOWS):
            _barrier(store, f"{name}/{window}", processes)
            start = time.monotonic()  # one clock for every process of the host
            for _ in range(work[name]):
                run()
            spans.setdefault(name, []).append((start, time.monotonic()))
    Path(scratch, f"spans-{rank}.json").write_text(json.dumps(spans))


def _barrier(store: dist.Store, name: str, processes: int) -> None:
    """Return once every one of ``processes`` has arrived at ``name`` (within a millisecond of each other)."""
    store.add(name, 1)
    while store.add(name, 0) < processes:
        time.sleep(0.001)


def _matmul_run(dtype: str) -> Any:
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=torch.Generator().manual_seed(0)).to(TORCH_DTYPES[dtype])
    b = a.clone()
    return lambda: a @ b


def _crowded_all_reduce_seconds(world_size: int, repeats: int = 40) -> dict[str, Any]:
    """``world_size`` gloo processes (more than the cores): one small all-reduce among all of them back to back
    (``seconds``), and the crowded group figures (``groups_us``, see :func:`_crowded_group_latency_us`)."""
    with tempfile.TemporaryDirectory(prefix="lightning-parallel-hw-") as scratch:
        init, out = Path(scratch) / "store", Path(scratch) / "result.json"
        mp.start_processes(_crowded_worker, args=(world_size, str(init), str(out), repeats), nprocs=world_size, start_method="spawn")
        return json.loads(out.read_text())


def _crowded_worker(rank: int, world_size: int, init: str, out: str, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(_BACKEND, init_method=f"file://{init}", rank=rank, world_size=world_size)
    try:
        small = torch.zeros(SMALL_BYTES // 4)
        for _ in range(3):  # warm-up (connections, buffers)
            collectives.all_reduce(small)
        # No barrier between calls: as in a training step, each rank enters when it gets there.
        start = time.perf_counter()
        for _ in range(repeats):
            collectives.all_reduce(small)
        seconds = (time.perf_counter() - start) / repeats
        groups = _crowded_group_latency_us(rank, world_size, small)
        if rank == 0:
            Path(out).write_text(json.dumps({"seconds": seconds, "groups_us": groups}))
    finally:
        dist.destroy_process_group()


def _crowded_group_latency_us(rank: int, world_size: int, tensor: torch.Tensor, repeats: int = 20) -> dict[str, list[list[float]]]:
    """Group size (2, 4, ... up to ``world_size``) -> one point per :data:`CROWDED_GAP_MATMULS`: [wall microseconds of
    the compute each rank ran between two collectives, microseconds of one small all-reduce], means over the ranks.

    Every group of the node runs at once, as a layout's tensor-parallel groups do: a rank waits in the collective
    until each peer has been scheduled and finished its compute, which takes longer the more compute it had to do
    on a time-sliced core (the planner interpolates at a layout's own compute between collectives)."""
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    sizes = [size for size in (2**k for k in range(1, world_size.bit_length())) if world_size % size == 0]
    figures: dict[str, list[list[float]]] = {}
    for size in sizes:
        # new_group is collective: every rank creates every group, in the same order.
        group = [dist.new_group(list(range(first, first + size))) for first in range(0, world_size, size)][rank // size]
        collectives.all_reduce(tensor, group=group)  # warm-up (connections)
        points = []
        for matmuls in CROWDED_GAP_MATMULS:
            collectives.barrier()
            computing = waiting = 0.0
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(matmuls):
                    a @ b
                arrived = time.perf_counter()
                collectives.all_reduce(tensor, group=group)
                computing, waiting = computing + arrived - start, waiting + time.perf_counter() - arrived
            means = torch.tensor([computing, waiting], dtype=torch.float64) / repeats / world_size
            collectives.all_reduce(means)
            points.append([value * 1e6 for value in means.tolist()])
        figures[str(size)] = points
    return figures


def measured_profile_fields(devices_per_node: int, remeasure: bool | None = None) -> dict[str, object]:
    """A hardware profile's figures from this machine's measurements (``measured: true`` in a profile).

    One process alone trains on every core (``peak_tflops``; fewer if ``OMP_NUM_THREADS`` says); processes sharing the
    node get ``cores // processes`` threads each (Lightning's launchers), so together they reach what one-thread
    processes on every core measured at once (``node_tflops``, ``node_memory_gbps``).
    """
    found = local_measurements(remeasure)
    # OMP_NUM_THREADS (set by Lightning's launchers for several processes, or by the user) caps a lone process too.
    threads = max(1, min(found.cores, int(os.environ.get("OMP_NUM_THREADS") or found.cores)))

    def alone(dtype: str) -> float:
        return found.alone_tflops[dtype] if threads == found.cores else min(found.alone_tflops[dtype], found.per_thread_tflops[dtype] * threads)

    def alone_memory() -> float:
        if threads == found.cores:
            return found.alone_memory_gbps
        return min(found.alone_memory_gbps, found.per_thread_memory_gbps * threads)

    return {
        "peak_tflops": alone("fp32"),
        "peak_dtype": "fp32",
        "peak_tflops_by_dtype": {"fp64": alone("fp64")},
        "node_tflops": found.shared_tflops["fp32"],
        "intra_node_gbps": found.collective_gbps,
        "inter_node_gbps": found.collective_gbps,
        "intra_node_latency_us": found.collective_latency_us,
        "inter_node_latency_us": found.collective_latency_us,
        "lockstep_latency_us": found.lockstep_latency_us,
        "send_latency_us": found.send_latency_us,
        "device_memory_gib": found.memory_gib / devices_per_node,
        "dtensor_op_us": found.dtensor_op_us,
        "op_us": found.op_us,
        "optimizer_op_us": found.optimizer_op_us,
        "optimizer_dtensor_op_us": found.optimizer_dtensor_op_us,
        "pipeline_runtime_bytes": found.pipeline_runtime_bytes,
        "training_runtime_bytes": found.training_runtime_bytes,
        "memory_gbps": alone_memory(),
        # Matmuls at the measured peak: the roofline counts the rest (memory-bound operators, host time).
        "achievable_fraction": 1.0,
        "node_memory_gbps": found.shared_memory_gbps,
        "matmul_efficiency": found.matmul_efficiency,
        "crowded_latency_us": {int(n): us for n, us in found.crowded_latency_us.items()},
        "crowded_group_latency_us": {
            int(n): {int(size): [tuple(point) for point in points] for size, points in groups.items()}
            for n, groups in found.crowded_group_latency_us.items()
        },
        "crowded_node_tflops": {int(n): rates["fp32"] for n, rates in found.crowded_rates.items()},
        "crowded_node_memory_gbps": {int(n): rates["memory_gbps"] for n, rates in found.crowded_rates.items()},
        "host_cores": found.cores,
        "description": found.describe() + f" (cached in {cache_path()})",
    }
