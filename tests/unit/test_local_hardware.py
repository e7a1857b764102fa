"""The measured local hardware profile: measured once, cached per machine, re-measured on request, read by the profile."""

from __future__ import annotations

import pytest

from lightning_parallel.measure import hardware, measurement_cache
from lightning_parallel.plan.hardware import HardwareProfile

FIGURES = hardware.LocalMeasurements(
    host="here", cores=4, torch_version="x", backend="gloo", measured_at="now",
    alone_tflops={"fp32": 0.2, "fp64": 0.1}, per_thread_tflops={"fp32": 0.06, "fp64": 0.03},
    collective_gbps=0.8, collective_latency_us=1500.0, lockstep_latency_us=900.0, send_latency_us=150.0, memory_gib=32.0, dtensor_op_us=120.0, op_us=2.0,
    alone_memory_gbps=20.0, per_thread_memory_gbps=8.0, shared_tflops={"fp32": 0.2, "fp64": 0.1}, shared_memory_gbps=24.0,
    matmul_efficiency={"matmul/32": 0.5, "attention/32": 0.25, "matmul/512": 1.0}, crowded_latency_us={"8": 6000.0},
    optimizer_op_us=3.0, optimizer_dtensor_op_us=15.0, pipeline_runtime_bytes=35 * 2**20, training_runtime_bytes=2**20,
    crowded_rates={"8": {"fp32": 0.16, "fp64": 0.08, "memory_gbps": 16.0}},
    crowded_group_latency_us={"8": {"2": [[0.0, 1000.0], [8000.0, 6000.0]], "8": [[0.0, 14000.0], [6000.0, 21000.0]]}},
)


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Measuring returns FIGURES and counts its calls; the cache lives under tmp_path."""
    calls = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(measurement_cache.REMEASURE_ENV, raising=False)
    monkeypatch.setattr(hardware, "measure_here", lambda: calls.append(1) or FIGURES)
    return calls


def test_measured_once_then_read_from_the_cache_until_asked_again(measured, monkeypatch, tmp_path):
    assert hardware.local_measurements() == FIGURES and len(measured) == 1
    assert hardware.cache_path().is_relative_to(tmp_path) and hardware.cache_path().is_file()
    assert hardware.local_measurements() == FIGURES and len(measured) == 1
    monkeypatch.setenv(measurement_cache.REMEASURE_ENV, "1")
    hardware.local_measurements()
    assert len(measured) == 2
    hardware.cache_path().write_text("{not json")  # a damaged cache is measured again, not trusted
    monkeypatch.delenv(measurement_cache.REMEASURE_ENV)
    hardware.local_measurements()
    assert len(measured) == 3


def test_a_measured_profile_takes_this_machines_figures_and_keeps_what_it_writes(measured, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    profile = HardwareProfile.from_config({"name": "local", "measured": True, "devices_per_node": 8,
                                           "memory_reserve_fraction": 0.2, "inter_node_gbps": 0.1})
    # The node's figure is what one-thread processes on every core reached at once (not 4 × one thread alone).
    assert profile.peak_tflops == 0.2 and profile.node_tflops == pytest.approx(0.2) and profile.achievable_fraction == 1.0
    assert profile.peak_tflops_by_dtype == {"fp64": 0.1}
    assert profile.intra_node_gbps == 0.8 and profile.inter_node_gbps == 0.1  # written in the profile: kept
    assert profile.device_memory_gib == 4.0 and "measured on here" in profile.description
    # Alone a process has the whole node; two share it (each cores // 2 threads); eight share one thread's worth.
    assert profile.flops_per_device(1) == pytest.approx(0.2e12)
    assert profile.flops_per_device(2) == pytest.approx(0.1e12)
    # Eight processes on the 4 cores got 0.16 together (time slices, cache refills): 0.02 each, not 0.2 / 8.
    assert profile.flops_per_device(8) == pytest.approx(0.02e12)
    assert profile.flops_per_device(6) == pytest.approx(0.18e12 / 6)  # between 4 (the node's 0.2) and 8, linearly
    assert profile.flops_per_device(16) == pytest.approx(0.01e12)  # past 8: the node keeps the last figure
    assert profile.memory_bytes_per_second(8) == pytest.approx(2e9)
    # The roofline's other figures: memory bandwidth alone and shared, operator host time, matmul efficiency.
    assert profile.memory_bytes_per_second(1) == pytest.approx(20e9) and profile.memory_bytes_per_second(4) == pytest.approx(6e9)
    assert profile.op_seconds(2) == pytest.approx(2e-6) and profile.op_seconds(8) == pytest.approx(4e-6)
    assert profile.matmul_slowdown({"matmul/512": 1.0, "attention/32": 1.0}) == pytest.approx(2.5)  # (1 + 4) / 2
    # DTensor's host work per operator: measured alone, slower once the processes outnumber the 4 cores.
    assert profile.dtensor_op_seconds(2) == pytest.approx(120e-6) and profile.dtensor_op_seconds(8) == pytest.approx(240e-6)
    # The optimizer step's operators: no autograd, on plain tensors or DTensors, crowded alike.
    assert profile.optimizer_op_seconds(2, dtensor=False) == pytest.approx(3e-6)
    assert profile.optimizer_op_seconds(8, dtensor=True) == pytest.approx(30e-6)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a lone process on one thread gets one thread's peak
    one_thread = HardwareProfile.from_config({"name": "local", "measured": True, "devices_per_node": 8})
    assert one_thread.peak_tflops == pytest.approx(0.06) and one_thread.memory_gbps == pytest.approx(8.0)
    # Eight processes on the 4 cores: each message of a collective waits for its receiver to be scheduled again.
    assert profile.crowded_latency_us == {8: 6000.0}
    assert profile.crowded_group_latency_us == {8: {2: [(0.0, 1000.0), (8000.0, 6000.0)], 8: [(0.0, 14000.0), (6000.0, 21000.0)]}}
    assert profile.sharing_node(4).link(False, messages=14) == (0.8e9, pytest.approx(1500e-6))
    assert profile.sharing_node(8).link(False, messages=14) == (0.8e9, pytest.approx(6000e-6))  # all 8 ranks: as measured
    # How the ranks meet a collective: from compute of their own, in lockstep (tensor parallelism), a send to a waiting rank.
    assert profile.link(False, messages=2, meeting="lockstep") == (0.8e9, pytest.approx(900e-6))
    assert profile.link(False, messages=1, meeting="send") == (0.8e9, pytest.approx(150e-6))
    # Crowded, the peers are time-sliced and a waiting rank sleeps: both cost what ranks arriving apart do.
    assert profile.sharing_node(8).link(False, messages=1, meeting="send") == (0.8e9, pytest.approx(1500e-6))
    assert profile.sharing_node(8).link(False, messages=14, meeting="lockstep") == (0.8e9, pytest.approx(6000e-6))


def test_crowded_collective_latency_by_messages_between_and_past_the_measured_process_counts():
    profile = HardwareProfile(name="x", device_memory_gib=8, peak_tflops=0.1, achievable_fraction=0.5, devices_per_node=32,
                              intra_node_gbps=1, inter_node_gbps=1, intra_node_latency_us=500, host_cores=2,
                              crowded_latency_us={4: 6000.0, 8: 28000.0})
    # Per message: 2 cores' 500 µs over 2 ring messages, 4 processes' 6 ms over 6, 8 processes' 28 ms over 14.
    assert profile.crowded_message_us(2) == 250 and profile.crowded_message_us(4) == 1000 and profile.crowded_message_us(8) == 2000
    assert profile.crowded_message_us(3) == pytest.approx(625)  # between measured counts, linearly
    assert profile.crowded_message_us(16) == pytest.approx(4000)  # past 8: the 4 -> 8 power law goes on
    crowded = profile.sharing_node(8)
    assert crowded.link(False, messages=2) == (1e9, pytest.approx(4e-3))  # a 2-rank all-reduce among 8 processes
    assert crowded.link(False, messages=1) == (1e9, pytest.approx(2e-3))  # a pipeline send
    assert crowded.link(True, messages=2) == (1e9, pytest.approx(20e-6))  # across nodes: the network's own
    assert profile.sharing_node(2).link(False, messages=2) == (1e9, pytest.approx(500e-6))  # a core each: uncrowded
    uncrowded = HardwareProfile(name="gpu", device_memory_gib=80, peak_tflops=900, achievable_fraction=0.4, devices_per_node=8,
                                intra_node_gbps=400, inter_node_gbps=50)
    assert uncrowded.sharing_node(8).link(False, messages=14) == uncrowded.link(False)
    # A datasheet profile without the lockstep and send figures: every meeting costs the collective's latency.
    assert uncrowded.link(False, meeting="send") == uncrowded.link(False, meeting="lockstep") == uncrowded.link(False)
    with pytest.raises(ValueError, match="meeting='waiting'"):
        uncrowded.link(False, meeting="waiting")


def test_crowded_group_collectives_cost_what_such_groups_measured():
    """A collective of a group of ranks on a crowded node costs the figure measured for such groups, every group at once,
    at the layout's own compute between collectives: a peer's wait grows with the compute it had to finish."""
    profile = HardwareProfile(
        name="x", device_memory_gib=8, peak_tflops=0.1, achievable_fraction=0.5, devices_per_node=32, intra_node_gbps=1,
        inter_node_gbps=1, intra_node_latency_us=500, host_cores=2, crowded_latency_us={4: 6000.0, 8: 28000.0},
        crowded_group_latency_us={4: {2: [(0, 800), (4000, 3000)], 4: [(0, 4000), (4000, 7000)]},
                                  8: {2: [(0, 1000), (8000, 6000)], 8: [(0, 14000), (6000, 21000)]}},
    )
    # Linear in the compute between the measured points, flat past them; None is a whole step's compute.
    assert profile.crowded_collective_us(4, 2, 0) == 800 and profile.crowded_collective_us(4, 2, 2000) == pytest.approx(1900)
    assert profile.crowded_collective_us(4, 2, None) == profile.crowded_collective_us(4, 2, 1e6) == 3000
    # Per ring message linear in the group size between those measured (1500 for 2 ranks, 7000 / 6 for 4), flat past.
    assert profile.crowded_collective_us(4, 3, None) == pytest.approx((1500 + 7000 / 6) / 2 * 4)
    assert profile.crowded_collective_us(4, 8, None) == pytest.approx(7000 / 6 * 14)
    # Between the process counts measured linear (from the uncrowded latency at the cores' count); past the last
    # growing with the processes each core takes turns with.
    assert profile.crowded_collective_us(6, 2, None) == pytest.approx(4500)
    assert profile.crowded_collective_us(3, 2, None) == pytest.approx(1750)
    assert profile.crowded_collective_us(16, 2, None) == pytest.approx(12000)
    crowded = profile.sharing_node(8)
    assert crowded.link(False, messages=2, meeting="lockstep", ranks=2, between_s=0.004) == (1e9, pytest.approx(3500e-6))
    assert crowded.link(False, messages=1, ranks=2, between_s=0.004) == (1e9, pytest.approx(1750e-6))  # an all-gather: half
    # A send keeps the per-message figure of the all-rank collective (28 ms over 14 messages); across nodes the network's.
    assert crowded.link(False, messages=1, meeting="send", ranks=2) == (1e9, pytest.approx(2000e-6))
    assert crowded.link(True, messages=2, ranks=2) == (1e9, pytest.approx(20e-6))
    # A core each: the table does not apply.
    assert profile.sharing_node(2).link(False, messages=2, meeting="lockstep", ranks=2, between_s=0.004) == (1e9, pytest.approx(500e-6))
    with pytest.raises(ValueError, match=r"crowded_group_latency_us\[4\]\[2\]"):
        HardwareProfile(name="x", device_memory_gib=8, peak_tflops=0.1, achievable_fraction=0.5, devices_per_node=4,
                        intra_node_gbps=1, inter_node_gbps=1, crowded_group_latency_us={4: {2: [(0, -1)]}})
