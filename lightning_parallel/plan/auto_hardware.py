"""``hardware=auto``: whatever machine this is, measured once and cached — the host and gloo on a CPU machine
(``cpu_local``'s figures), the GPUs and NCCL on a GPU node (:mod:`lightning_parallel.measure.gpu_hardware`).

A GPU is recognised by the name CUDA reports (:mod:`lightning_parallel.plan.gpus`; an unknown name is refused, never
taken for a relative's). The profile then has:

- MFU's divisor: the datasheet's dense peak per dtype (as torchtitan and Megatron report MFU), and an achievable
  fraction that is the datasheet profile's typical MFU (0.4) scaled by how much of the datasheet peak this GPU's
  own bf16 matmul reached (a power-capped or throttled card plans slower);
- memory: what the device reports;
- inside a node: the measured all-reduce among all of the node's GPUs (bus bandwidth, latency), and a send's
  latency between two of them;
- across nodes: measured where a job across them ran ``python -m lightning_parallel.plan.auto_hardware`` under
  torchrun (the cache is keyed by node count), else the catalogue profile's datasheet figures (one node cannot
  measure InfiniBand), and the description says which.

Run alone on a node, ``python -m lightning_parallel.plan.auto_hardware`` measures it (again) and prints the profile.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import yaml

from lightning_parallel.conf import CONFIG_DIR
from lightning_parallel.measure import gpu_hardware
from lightning_parallel.plan.gpus import GPUSpec, gpu_spec

#: The keys ``hardware: auto`` consumes (the rest of its file wins over what it resolves to, as for any profile).
AUTO_KEYS = ("measured", "nodes")
#: Typical model FLOPs utilisation of large-model training on a GPU at its full datasheet peak (the datasheet
#: profiles' ``achievable_fraction``), scaled by the share of that peak the GPU's matmul measured.
DATASHEET_MFU = 0.4


def resolve(config: Mapping[str, Any]) -> dict[str, Any]:
    """The whole profile ``hardware: auto`` stands for on this machine, measured figures included (keys of ``config``
    besides :data:`AUTO_KEYS` win).

    Raises:
        ValueError: ``nodes`` is not a positive int, or the GPU is not in the catalogue (``UnknownGPUError``).
    """
    nodes = config.get("nodes", 1)
    if isinstance(nodes, str) and nodes.startswith("${"):
        nodes = 1  # the file read as it is, outside Hydra: no trainer.num_nodes to interpolate
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"hardware.nodes={nodes!r} must be a positive int (the run's trainer.num_nodes).")
    own = {key: value for key, value in config.items() if key not in AUTO_KEYS}
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return {**gpu_profile(nodes), **own}
    # A CPU machine: exactly cpu_local (its file's keys over this machine's measured figures).
    from lightning_parallel.measure.hardware import measured_profile_fields

    cpu_local = {**yaml.safe_load((CONFIG_DIR / "hardware" / "cpu_local.yaml").read_text()), **own}
    return {**measured_profile_fields(int(cpu_local["devices_per_node"])), **cpu_local}


def gpu_profile(nodes: int, remeasure: bool | None = None) -> dict[str, Any]:
    """A hardware profile's fields for this node's GPUs (measured, or read from the cache) in a run of ``nodes``."""
    spec = gpu_spec(torch.cuda.get_device_name(0))
    gpus = torch.cuda.device_count()
    across = gpu_hardware.read(gpu_hardware.cache_path(gpu_hardware.cache_key(spec.key, gpus, nodes))) if nodes > 1 else None
    found = across or gpu_hardware.cached_measurements(
        gpu_hardware.cache_key(spec.key, gpus, 1), lambda: gpu_hardware.measure_node(gpus), remeasure
    )
    return profile_fields(spec, found)


def datasheet_profile(spec: GPUSpec) -> dict[str, Any]:
    """The catalogue profile's figures for ``spec`` (``conf/hardware/<profile>.yaml``), or the catalogue's own."""
    if spec.profile is not None:
        return yaml.safe_load((CONFIG_DIR / "hardware" / f"{spec.profile}.yaml").read_text())
    return {"intra_node_gbps": spec.nvlink_gbps or 25.0, "inter_node_gbps": 50.0, "intra_node_latency_us": 5.0,
            "inter_node_latency_us": 15.0}


def profile_fields(spec: GPUSpec, found: gpu_hardware.GPUMeasurements) -> dict[str, Any]:
    """:class:`~lightning_parallel.plan.hardware.HardwareProfile` fields from ``found`` on GPUs of ``spec``."""
    sheet = datasheet_profile(spec)
    peaks = spec.profile_peaks()
    reached = found.matmul_tflops.get("bf16", 0.0) / spec.bf16_tflops
    fields: dict[str, Any] = {
        "name": f"{spec.key}_measured",
        "device_memory_gib": found.memory_gib,
        "peak_tflops": peaks["bf16"],
        "peak_dtype": "bf16",
        "peak_tflops_by_dtype": {dtype: peak for dtype, peak in peaks.items() if dtype != "bf16"},
        "achievable_fraction": min(1.0, max(DATASHEET_MFU * reached, 1e-3)),
        "devices_per_node": found.gpus_per_node,
        "intra_node_gbps": sheet["intra_node_gbps"],
        "intra_node_latency_us": sheet.get("intra_node_latency_us", 5.0),
        "inter_node_gbps": sheet["inter_node_gbps"],
        "inter_node_latency_us": sheet.get("inter_node_latency_us", 15.0),
        "memory_reserve_fraction": 0.1,
        "node_tflops": None,
        "measured": True,
    }
    where = []
    node = str(found.gpus_per_node)
    if node in found.intra_node.get("all_reduce", {}):
        figure = found.intra_node["all_reduce"][node]
        fields.update(intra_node_gbps=figure["gbps"], intra_node_latency_us=figure["latency_us"])
        where.append("inside a node measured")
    if "2" in found.intra_node.get("send_recv", {}):
        fields["send_latency_us"] = found.intra_node["send_recv"]["2"]["latency_us"]
    if str(found.nodes) in found.inter_node.get("all_reduce", {}):
        figure = found.inter_node["all_reduce"][str(found.nodes)]
        fields.update(inter_node_gbps=figure["gbps"], inter_node_latency_us=figure["latency_us"])
        where.append("across nodes measured")
    else:
        where.append(f"across nodes from {spec.profile or 'the catalogue'}'s datasheet figures")
    path = gpu_hardware.cache_path(gpu_hardware.cache_key(spec.key, found.gpus_per_node, found.nodes))
    fields["description"] = f"{found.describe()}; {', '.join(where)} (cached in {path})"
    return fields


def main() -> None:
    """Measure this node's GPUs (alone), or, under torchrun across several nodes, every node's and the links
    between them (each node's local rank 0 writes its cache); print the profile."""
    if "LOCAL_WORLD_SIZE" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > int(os.environ["LOCAL_WORLD_SIZE"]):
        _measure_across_nodes()
        return
    print(yaml.safe_dump(gpu_profile(1, remeasure=True), sort_keys=False))


def _measure_across_nodes() -> None:
    import torch.distributed as dist

    local_rank, gpus = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        spec = gpu_spec(torch.cuda.get_device_name(device))
        nodes = dist.get_world_size() // gpus
        found = gpu_hardware.measure_in_world(gpus, device)
        record = gpu_hardware.measurements(found, torch.cuda.get_device_name(device), gpus, nodes,
                                           torch.cuda.get_device_properties(device).total_memory / 2**30)
        if local_rank == 0:
            gpu_hardware.write(gpu_hardware.cache_path(gpu_hardware.cache_key(spec.key, gpus, nodes)), record)
            if dist.get_rank() == 0:
                print(yaml.safe_dump(profile_fields(spec, record), sort_keys=False))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
