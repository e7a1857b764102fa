"""``hardware=auto`` and the GPU measurement behind it, checked on a CPU machine.

The auto profile here is cpu_local's; its GPU path runs with CUDA's answers stood in (the GPU's name and count) and
a measurement made by the same functions on two host processes over gloo (``measure_node(backend="gloo")``): what a
GPU node does that a CPU cannot (CUDA events, NCCL) is unverified here (docs/gpu.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from lightning_parallel.conf import CONFIG_DIR
from lightning_parallel.measure import gpu_hardware, measurement_cache
from lightning_parallel.plan import auto_hardware
from lightning_parallel.plan.gpus import UnknownGPUError, gpu_spec
from lightning_parallel.plan.hardware import HardwareProfile
ROOT = Path(__file__).resolve().parents[2]

TINY = gpu_hardware.Sizes(matmul=64, small_bytes=256, large_bytes=64 * 2**10, matmul_repeats=3, collective_repeats=4)


@pytest.fixture(scope="module")
def measured_on_host() -> gpu_hardware.GPUMeasurements:
    """The GPU measurement's own code on two gloo processes (host clock instead of CUDA events)."""
    return gpu_hardware.measure_node(2, backend="gloo", sizes=TINY)


def test_the_measurement_has_every_collective_per_group_size_and_every_dtype(measured_on_host):
    found = measured_on_host
    assert found.gpus_per_node == 2 and found.nodes == 1 and found.inter_node == {}
    assert set(found.matmul_tflops) == {"bf16", "fp16", "fp32", "fp64"}  # tf32 is CUDA's
    assert all(rate > 0 for rate in found.matmul_tflops.values())
    assert set(found.intra_node) == set(gpu_hardware.COLLECTIVES)
    for name, by_size in found.intra_node.items():
        assert set(by_size) == {"2"}, name
        assert by_size["2"]["latency_us"] > 0 and by_size["2"]["gbps"] > 0, name


def test_group_sizes_inside_a_node():
    assert gpu_hardware._group_sizes(8) == [2, 4, 8]
    assert gpu_hardware._group_sizes(6) == [2, 4, 6]
    assert gpu_hardware._group_sizes(1) == []


def _stand_in_gpus(monkeypatch, name: str = "NVIDIA H100 80GB HBM3", count: int = 8) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_auto_on_a_gpu_node_measures_once_then_reads_the_cache(monkeypatch, tmp_path, measured_on_host):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(measurement_cache.REMEASURE_ENV, raising=False)
    _stand_in_gpus(monkeypatch)
    # The host measurement stands in for the GPUs' (8 of them: the all-reduce among the whole node is "8").
    node = {name: {"8": figures["2"]} for name, figures in measured_on_host.intra_node.items()}
    node["send_recv"]["2"] = measured_on_host.intra_node["send_recv"]["2"]
    stand_in = dataclasses.replace(measured_on_host, device_name="NVIDIA H100 80GB HBM3", gpus_per_node=8, memory_gib=79.1,
                                   matmul_tflops={"bf16": 742.0, "fp32": 60.0}, intra_node=node)
    calls = []
    monkeypatch.setattr(gpu_hardware, "measure_node", lambda processes=None, **_: calls.append(processes) or stand_in)

    profile = HardwareProfile.from_config({"measured": "auto", "nodes": 1})
    assert calls == [8]  # measured: cache miss
    assert profile.name == "h100_sxm_measured" and profile.measured and profile.devices_per_node == 8
    assert profile.peak_tflops == 989 and profile.peak_dtype == "bf16"  # MFU's divisor: the datasheet's
    assert profile.achievable_fraction == pytest.approx(auto_hardware.DATASHEET_MFU * 742 / 989)
    assert profile.device_memory_gib == 79.1
    assert profile.intra_node_gbps == pytest.approx(node["all_reduce"]["8"]["gbps"])
    assert profile.intra_node_latency_us == pytest.approx(node["all_reduce"]["8"]["latency_us"])
    assert profile.send_latency_us == pytest.approx(node["send_recv"]["2"]["latency_us"])
    sheet = yaml.safe_load((CONFIG_DIR / "hardware" / "h100_ib.yaml").read_text())
    assert profile.inter_node_gbps == sheet["inter_node_gbps"]  # one node cannot measure InfiniBand
    assert "datasheet" in profile.description and "cached in" in profile.description

    again = HardwareProfile.from_config({"measured": "auto", "nodes": 4, "device_memory_gib": 70})
    assert calls == [8]  # cache hit (the node's measurement; no cross-node one was cached for 4 nodes)
    assert again.device_memory_gib == 70 and again.intra_node_gbps == profile.intra_node_gbps  # keys given win

    # A job across 4 nodes wrote its measurement: its InfiniBand figures replace the datasheet's.
    across = dataclasses.replace(stand_in, nodes=4, inter_node={"all_reduce": {"4": {"latency_us": 30.0, "gbps": 44.0}}})
    key = gpu_hardware.cache_key("h100_sxm", 8, 4)
    gpu_hardware.write(gpu_hardware.cache_path(key), across)
    measured_across = HardwareProfile.from_config({"measured": "auto", "nodes": 4})
    assert (measured_across.inter_node_gbps, measured_across.inter_node_latency_us) == (44.0, 30.0)
    assert "across nodes measured" in measured_across.description and calls == [8]

    auto_hardware.gpu_profile(1, remeasure=True)
    assert calls == [8, 8]  # LIGHTNING_PARALLEL_MEASURE_HARDWARE / remeasure measures again
    assert "torch" in key and "nccl" in key and key.startswith("h100_sxm-x8-4nodes")


def test_auto_refuses_a_gpu_the_catalogue_does_not_know(monkeypatch):
    _stand_in_gpus(monkeypatch, name="NVIDIA H100 80GB HBM3 MIG 3g.40gb")
    with pytest.raises(UnknownGPUError, match="MIG 3g.40gb"):
        HardwareProfile.from_config({"measured": "auto"})
    with pytest.raises(ValueError, match="hardware.nodes=0"):
        HardwareProfile.from_config({"measured": "auto", "nodes": 0})


def test_auto_is_cpu_local_on_a_cpu_machine_and_the_recipe_default(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    stand_in = {"peak_tflops": 0.1, "intra_node_gbps": 1.0, "inter_node_gbps": 1.0, "device_memory_gib": 2.0,
                "achievable_fraction": 1.0, "description": "stand-in for this machine's measurement"}
    import lightning_parallel.measure.hardware as cpu_hardware

    monkeypatch.setattr(cpu_hardware, "measured_profile_fields", lambda devices_per_node, remeasure=None: dict(stand_in))
    cpu_local = HardwareProfile.from_config(yaml.safe_load((CONFIG_DIR / "hardware" / "cpu_local.yaml").read_text()))
    for trainer in ("cpu", "gpu"):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[f"trainer={trainer}", "trainer.num_nodes=2"])
        assert cfg.hardware.measured == "auto" and cfg.hardware.nodes == 2
        from lightning_parallel.plan.config import hardware_from_config

        assert hardware_from_config(cfg) == cpu_local  # no GPU here: the same profile, name and figures


def test_gpu_profile_fields_on_one_gpu_keep_the_datasheet_links():
    spec = gpu_spec("NVIDIA H200")
    found = gpu_hardware.GPUMeasurements("NVIDIA H200", 1, 1, "t", "n", "now", 139.8, {"bf16": 800.0}, {}, {})
    fields = auto_hardware.profile_fields(spec, found)
    assert fields["name"] == "h200_sxm_measured" and fields["intra_node_gbps"] == 450 and fields["device_memory_gib"] == 139.8
    HardwareProfile(**{k: v for k, v in fields.items()})  # a valid profile
