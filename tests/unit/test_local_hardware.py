"""The measured local hardware profile: measured once, cached per machine, re-measured on request, read by the profile."""

from __future__ import annotations

import pytest

from lightning_parallel.measure import hardware
from lightning_parallel.plan.hardware import HardwareProfile

FIGURES = hardware.LocalMeasurements(
    host="here", cores=4, torch_version="x", backend="gloo", measured_at="now",
    alone_tflops={"fp32": 0.2, "fp64": 0.1}, per_thread_tflops={"fp32": 0.06, "fp64": 0.03},
    collective_gbps=0.8, collective_latency_us=1500.0, memory_gib=32.0, dtensor_op_us=120.0,
)


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Measuring returns FIGURES and counts its calls; the cache lives under tmp_path."""
    calls = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(hardware.REMEASURE_ENV, raising=False)
    monkeypatch.setattr(hardware, "measure_here", lambda: calls.append(1) or FIGURES)
    return calls


def test_measured_once_then_read_from_the_cache_until_asked_again(measured, monkeypatch, tmp_path):
    assert hardware.local_measurements() == FIGURES and len(measured) == 1
    assert hardware.cache_path().is_relative_to(tmp_path) and hardware.cache_path().is_file()
    assert hardware.local_measurements() == FIGURES and len(measured) == 1
    monkeypatch.setenv(hardware.REMEASURE_ENV, "1")
    hardware.local_measurements()
    assert len(measured) == 2
    hardware.cache_path().write_text("{not json")  # a damaged cache is measured again, not trusted
    monkeypatch.delenv(hardware.REMEASURE_ENV)
    hardware.local_measurements()
    assert len(measured) == 3


def test_a_measured_profile_takes_this_machines_figures_and_keeps_what_it_writes(measured, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    profile = HardwareProfile.from_config({"name": "local", "measured": True, "achievable_fraction": 0.5, "devices_per_node": 8,
                                           "memory_reserve_fraction": 0.2, "inter_node_gbps": 0.1})
    assert profile.peak_tflops == 0.2 and profile.node_tflops == pytest.approx(0.24)
    assert profile.peak_tflops_by_dtype == {"fp64": 0.1}
    assert profile.intra_node_gbps == 0.8 and profile.inter_node_gbps == 0.1  # written in the profile: kept
    assert profile.device_memory_gib == 4.0 and "measured on here" in profile.description
    # Alone a process has the whole node; two share it (each cores // 2 threads); eight share one thread's worth.
    assert profile.flops_per_device(1) == pytest.approx(0.2e12 * 0.5)
    assert profile.flops_per_device(2) == pytest.approx(0.12e12 * 0.5)
    assert profile.flops_per_device(8) == pytest.approx(0.03e12 * 0.5)
    # DTensor's host work per operator: measured alone, slower once the processes outnumber the 4 cores.
    assert profile.dtensor_op_seconds(2) == pytest.approx(120e-6) and profile.dtensor_op_seconds(8) == pytest.approx(240e-6)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a lone process on one thread gets one thread's peak
    one_thread = HardwareProfile.from_config({"name": "local", "measured": True, "achievable_fraction": 0.5, "devices_per_node": 8})
    assert one_thread.peak_tflops == pytest.approx(0.06)
