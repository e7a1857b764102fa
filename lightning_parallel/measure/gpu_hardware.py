"""The GPUs a run has, measured once and cached: matmul peak per dtype, and each collective's latency and bandwidth
per group size inside a node (and across nodes when the measuring job spans several).

Device work is timed with CUDA events (:class:`~lightning_parallel.measure.device_clock.DeviceClock`): a window of
``repeats`` operations is marked on the stream before and after, and the events are read once, at the window's edge.
The same functions measure the host and gloo where there is no GPU (host clock; what the CPU suite checks of them).

Collectives: every rank of the node takes part in groups of consecutive ranks (2, 4, ... up to the node's GPUs, all
groups of a size at once, as a layout's tensor- or data-parallel groups run), and across nodes in the groups of one
rank per node. For each of all-reduce, all-gather, reduce-scatter, all-to-all and send/receive the figures are a
small message's time (latency) and a large message's bus bandwidth: the bytes each rank puts on its links per second, as nccl-tests reports it (all-reduce ``2 (n − 1) / n`` × the payload,
all-gather / reduce-scatter / all-to-all ``(n − 1) / n`` × the whole buffer, a send its payload), the figure a
profile's ``intra_node_gbps`` and ``inter_node_gbps`` are.

Cached in ``$XDG_CACHE_HOME/lightning_parallel/hardware/`` under a key the caller gives (the GPU's catalogue name,
its count per node, the node count, torch and NCCL versions: :func:`cache_key`); ``LIGHTNING_PARALLEL_MEASURE_HARDWARE=1``
measures again. One node is measured by spawning one process per GPU (:func:`measure_node`); several by running
``torchrun --nnodes N --nproc-per-node G -m lightning_parallel.plan.auto_hardware`` across them, which measures inside
the job's own process group (:func:`measure_in_world`) and writes the cache on each node.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_parallel import collectives
from lightning_parallel.measure.device_clock import DeviceClock
from lightning_parallel.measure import measurement_cache

#: Dtypes whose matmul peak is measured (``tf32``: float32 with TF32 tensor cores allowed).
GPU_DTYPES = ("bf16", "fp16", "tf32", "fp32", "fp64")
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32,
                 "fp64": torch.float64}
#: The collectives measured, each with its bus-bandwidth factor for ``n`` ranks (nccl-tests' ``busbw``).
COLLECTIVES: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}


@dataclass(frozen=True)
class Sizes:
    """What one measurement runs: matmul side, small and large message bytes, repeats per timing window."""

    matmul: int = 8192
    small_bytes: int = 8 * 2**10
    large_bytes: int = 256 * 2**20
    matmul_repeats: int = 20
    collective_repeats: int = 20


#: On a GPU: matmuls that fill it, messages big enough for the bus bandwidth (NVLink needs hundreds of MiB).
GPU_SIZES = Sizes()


@dataclass(frozen=True)
class GPUMeasurements:
    """What was measured on this node's GPUs (TFLOP/s, microseconds, GB/s of bus bandwidth per rank)."""

    device_name: str  # as CUDA reports it
    gpus_per_node: int
    nodes: int
    torch_version: str
    nccl_version: str
    measured_at: str
    memory_gib: float  # one device's total memory
    matmul_tflops: dict[str, float]  # dtype -> dense matmul TFLOP/s (GPU_DTYPES)
    # collective -> group size (str, JSON keys) -> {"latency_us", "gbps"}; inside one node
    intra_node: dict[str, dict[str, dict[str, float]]]
    # the same among one rank per node (empty on one node)
    inter_node: dict[str, dict[str, dict[str, float]]]

    def describe(self) -> str:
        """One line of the figures (the profile's description)."""
        largest = str(max((int(n) for n in self.intra_node.get("all_reduce", {})), default=0))
        parts = [f"measured on {self.nodes} × {self.gpus_per_node} {self.device_name} (torch {self.torch_version}, NCCL "
                 f"{self.nccl_version}) at {self.measured_at}: matmul "
                 + ", ".join(f"{dtype} {tflops:.4g}" for dtype, tflops in self.matmul_tflops.items()) + " TFLOP/s"]
        if largest in self.intra_node.get("all_reduce", {}):
            figure = self.intra_node["all_reduce"][largest]
            parts.append(f"all-reduce among {largest} in a node {figure['gbps']:.4g} GB/s bus, {figure['latency_us']:.1f} µs")
        return "; ".join(parts)


def nccl_version() -> str:
    """NCCL's version as torch was built with it (``"none"`` without NCCL: a CPU build)."""
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return "none"


def cache_key(gpu_key: str, gpus_per_node: int, nodes: int) -> str:
    """The cache file's name for these GPUs: catalogue key, count per node, nodes, torch and NCCL versions."""
    key = f"{gpu_key}-x{gpus_per_node}-{nodes}nodes-torch{torch.__version__}-nccl{nccl_version()}"
    return key.replace("/", "_").replace("+", "_")


def cache_path(key: str) -> Path:
    """Where the measurements under ``key`` are kept (beside the CPU's, :func:`measure.hardware.cache_path`)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_parallel" / "hardware"
    return root / f"{key}.json"


def cached_measurements(key: str, measure: Callable[[], GPUMeasurements], remeasure: bool | None = None) -> GPUMeasurements:
    """The measurements cached under ``key``, or ``measure()``'s (:func:`measure_node`, or a test's stand-in),
    written there by one process while the others wait (:mod:`~lightning_parallel.measure.measurement_cache`)."""
    return measurement_cache.cached(cache_path(key), GPUMeasurements, measure, "this node's GPUs and NCCL (about a minute)", remeasure)


def read(path: Path) -> GPUMeasurements | None:
    """The measurements in ``path``; ``None`` if absent or written by another version of this file."""
    return measurement_cache.read(path, GPUMeasurements)


write = measurement_cache.write


def matmul_tflops(device: torch.device, dtype: str, size: int, repeats: int) -> float:
    """Dense ``size``² × ``size``² matmul TFLOP/s in ``dtype`` on ``device``: ``repeats`` of them between two marks
    of a :class:`DeviceClock` (one synchronize, at the end), after a warm-up (cuBLAS picks its kernel)."""
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {list(_TORCH_DTYPES)}.")
    on_cuda = device.type == "cuda"
    tf32 = torch.backends.cuda.matmul.allow_tf32 if on_cuda else None
    try:
        if on_cuda:
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        generator = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(size, size, generator=generator, device=device, dtype=_TORCH_DTYPES[dtype])
        b = torch.randn(size, size, generator=generator, device=device, dtype=_TORCH_DTYPES[dtype])
        clock = DeviceClock(device)
        for _ in range(2):
            a @ b
        start = clock.mark()
        for _ in range(repeats):
            a @ b
        seconds = DeviceClock.seconds(start, clock.mark())
    finally:
        if on_cuda:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    return 2 * size**3 * repeats / max(seconds, 1e-12) / 1e12


def _operation(name: str, group: dist.ProcessGroup, ranks: Sequence[int], device: torch.device, numel: int) -> Callable[[], None]:
    """One call of collective ``name`` over ``group`` with a buffer of ``numel`` bytes-as-uint8 per rank."""
    n = len(ranks)
    numel -= numel % n  # the buffers split evenly over the group
    whole = torch.zeros(numel, dtype=torch.uint8, device=device)
    part = torch.zeros(numel // n, dtype=torch.uint8, device=device)
    if name == "all_reduce":
        return lambda: collectives.all_reduce(whole, group=group)
    if name == "all_gather":
        return lambda: collectives.all_gather_into_tensor(whole, part, group=group)
    if name == "reduce_scatter":
        return lambda: collectives.reduce_scatter_tensor(part, whole, group=group)
    if name == "all_to_all":
        out = torch.empty_like(whole)
        return lambda: collectives.all_to_all_single(out, whole, group=group)
    if name == "send_recv":
        # Pairs of ranks (group ranks 2k and 2k + 1; an odd last rank sits out): half a ping-pong per call.
        me = ranks.index(dist.get_rank())
        peer = me + 1 if me % 2 == 0 else me - 1
        if peer >= n:
            return lambda: None
        first, second = (collectives.send, collectives.recv) if me % 2 == 0 else (collectives.recv, collectives.send)
        return lambda: (first(whole, ranks[peer], group=group), second(whole, ranks[peer], group=group))
    raise ValueError(f"collective={name!r} is not one of {list(COLLECTIVES)}.")


def _seconds_per_call(call: Callable[[], None], group: dist.ProcessGroup, device: torch.device, repeats: int) -> float:
    """Mean seconds of ``call`` over ``repeats`` back to back, timed on the device; ranks start together."""
    call()  # warm-up: connections, buffers
    collectives.barrier(group)
    clock = DeviceClock(device)
    start = clock.mark()
    for _ in range(repeats):
        call()
    return DeviceClock.seconds(start, clock.mark()) / repeats


def collective_figures(
    group: dist.ProcessGroup, ranks: Sequence[int], device: torch.device, sizes: Sizes
) -> dict[str, dict[str, float]]:
    """Collective -> ``{"latency_us", "gbps"}`` over ``group`` (whose global ranks are ``ranks``), this rank's view.

    Latency: a small message's time. Bus bandwidth: the large message's bus bytes over its time (nccl-tests'
    ``busbw``; at hundreds of MiB the fixed cost is a rounding error). Every rank of the world calls this at once, each for its own group."""
    n = len(ranks)
    figures = {}
    for name, factor in COLLECTIVES.items():
        small = _seconds_per_call(_operation(name, group, ranks, device, sizes.small_bytes), group, device, sizes.collective_repeats)
        large_call = _operation(name, group, ranks, device, sizes.large_bytes)
        large = _seconds_per_call(large_call, group, device, max(2, sizes.collective_repeats // 4))
        payload = sizes.large_bytes - sizes.large_bytes % n
        moved = factor(n) * payload if name != "send_recv" else payload
        figures[name] = {"latency_us": small * 1e6, "gbps": moved / large / 1e9}
    return figures


def _group_sizes(gpus_per_node: int) -> list[int]:
    """Group sizes measured inside a node: powers of two from 2 up to the node's GPUs, and the node itself."""
    sizes = [2**k for k in range(1, gpus_per_node.bit_length()) if 2**k <= gpus_per_node]
    return sorted(set(sizes + ([gpus_per_node] if gpus_per_node > 1 else [])))


def _ranks_mean(figures: dict[str, dict[str, float]], device: torch.device) -> dict[str, dict[str, float]]:
    """Each figure's mean over the world's ranks (every rank measured its own group)."""
    keys = [(name, field) for name in sorted(figures) for field in sorted(figures[name])]
    values = torch.tensor([figures[name][field] for name, field in keys], dtype=torch.float64, device=device)
    collectives.all_reduce(values)
    means = (values / dist.get_world_size()).tolist()
    result: dict[str, dict[str, float]] = {}
    for (name, field), value in zip(keys, means):
        result.setdefault(name, {})[field] = value
    return result


def measure_in_world(gpus_per_node: int, device: torch.device, sizes: Sizes = GPU_SIZES) -> dict[str, Any]:
    """Every figure, measured by every rank of the initialised world (``gpus_per_node`` consecutive ranks per node):
    matmul TFLOP/s per dtype (the median over ranks), and per collective and group size the latency and bus bandwidth
    inside a node and, with several nodes, among one rank per node (means over ranks). Collective: every rank calls it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % gpus_per_node:
        raise ValueError(f"gpus_per_node={gpus_per_node} does not divide the world's {world} ranks.")
    dtypes = [dtype for dtype in GPU_DTYPES if device.type == "cuda" or dtype != "tf32"]
    rates = torch.tensor([matmul_tflops(device, dtype, sizes.matmul, sizes.matmul_repeats) for dtype in dtypes],
                         dtype=torch.float64, device=device)
    gathered = torch.stack(collectives.all_gather(rates)).cpu()
    matmul = {dtype: float(statistics.median(gathered[:, i].tolist())) for i, dtype in enumerate(dtypes)}
    intra: dict[str, dict[str, dict[str, float]]] = {}
    for size in _group_sizes(gpus_per_node):
        # new_group is collective: every rank creates every group, in the same order (none straddles a node).
        groups = [list(range(first, first + size)) for node in range(0, world, gpus_per_node)
                  for first in range(node, node + gpus_per_node - size + 1, size)]
        created = [dist.new_group(ranks) for ranks in groups]
        mine = next((i for i, ranks in enumerate(groups) if rank in ranks), None)
        figures = collective_figures(created[mine], groups[mine], device, sizes) if mine is not None else {}
        # Ranks past the last whole group (a node of 6 GPUs, groups of 4) measured nothing: averaged over those that did.
        for name, by_field in _mean_of_measuring(figures, device).items():
            intra.setdefault(name, {})[str(size)] = by_field
    inter: dict[str, dict[str, dict[str, float]]] = {}
    nodes = world // gpus_per_node
    if nodes > 1:
        groups = [list(range(local, world, gpus_per_node)) for local in range(gpus_per_node)]
        created = [dist.new_group(ranks) for ranks in groups]
        figures = collective_figures(created[rank % gpus_per_node], groups[rank % gpus_per_node], device, sizes)
        inter = {name: {str(nodes): by_field} for name, by_field in _ranks_mean(figures, device).items()}
    return {"matmul_tflops": matmul, "intra_node": intra, "inter_node": inter}


def _mean_of_measuring(figures: dict[str, dict[str, float]], device: torch.device) -> dict[str, dict[str, float]]:
    """Means over the ranks that measured (a rank with no group passes zeros and is not counted)."""
    keys = [(name, field) for name in COLLECTIVES for field in ("latency_us", "gbps")]
    values = torch.tensor([figures.get(name, {}).get(field, 0.0) for name, field in keys] + [1.0 if figures else 0.0],
                          dtype=torch.float64, device=device)
    collectives.all_reduce(values)
    counted = max(values[-1].item(), 1.0)
    result: dict[str, dict[str, float]] = {}
    for (name, field), value in zip(keys, (values[:-1] / counted).tolist()):
        result.setdefault(name, {})[field] = value
    return result


def measurements(found: dict[str, Any], device_name: str, gpus_per_node: int, nodes: int, memory_gib: float) -> GPUMeasurements:
    """:func:`measure_in_world`'s figures as a cacheable record."""
    return GPUMeasurements(
        device_name=device_name, gpus_per_node=gpus_per_node, nodes=nodes, torch_version=torch.__version__,
        nccl_version=nccl_version(), measured_at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        memory_gib=memory_gib, matmul_tflops=found["matmul_tflops"], intra_node=found["intra_node"],
        inter_node=found["inter_node"],
    )


def measure_node(processes: int | None = None, backend: str = "nccl", sizes: Sizes = GPU_SIZES) -> GPUMeasurements:
    """This node measured now: one spawned process per GPU (``processes``, default every GPU) on ``backend``.

    ``backend="gloo"`` with no GPU runs the same code on host processes (what the CPU suite checks)."""
    on_cuda = backend != "gloo"
    if on_cuda and not torch.cuda.is_available():
        raise RuntimeError("measure_node(backend='nccl') needs CUDA GPUs; this machine has none (measure.hardware "
                           "measures a CPU host).")
    processes = processes or (torch.cuda.device_count() if on_cuda else 2)
    with tempfile.TemporaryDirectory(prefix="lightning-parallel-gpu-hw-") as scratch:
        out = Path(scratch) / "result.json"
        mp.start_processes(_node_worker, args=(processes, str(Path(scratch) / "store"), str(out), backend, asdict(sizes)),
                           nprocs=processes, start_method="spawn")
        found = json.loads(out.read_text())
    if on_cuda:
        properties = torch.cuda.get_device_properties(0)
        name, memory = torch.cuda.get_device_name(0), properties.total_memory / 2**30
    else:
        name, memory = "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return measurements(found, name, processes, 1, memory)


def _node_worker(rank: int, world: int, init: str, out: str, backend: str, sizes: dict[str, int]) -> None:
    device = torch.device("cuda", rank) if backend != "gloo" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world,
                            **({"device_id": device} if device.type == "cuda" else {}))
    try:
        found = measure_in_world(world, device, Sizes(**sizes))
        if rank == 0:
            Path(out).write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()
