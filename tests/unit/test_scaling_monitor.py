"""ScalingMonitor in one process: it measures, compares with the prediction, writes its files, and cleans up."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed._functional_collectives as funcol

from lightning_parallel import ScalingMonitor
from lightning_parallel.measure.collectives import DTensorCollectives
from tests.harness import JobSpec, build
from tests.planner_check import ANY_HARDWARE, _profile

SPEC = JobSpec(batch_size=8, steps=4, n_layer=2)


def fit_with(monitor: ScalingMonitor):
    model, data, trainer, _ = build(SPEC)
    trainer.callbacks.insert(0, monitor)
    trainer.fit(model, datamodule=data)
    return trainer


def test_monitor_reports_measured_and_predicted(tmp_path):
    profile = _profile("gpt", SPEC.n_layer, SPEC.n_embd, SPEC.tie_weights, SPEC.batch_size, SPEC.precision, 1)
    monitor = ScalingMonitor(hardware=ANY_HARDWARE, profile=profile, output_dir=tmp_path)
    all_reduce = funcol.all_reduce
    fit_with(monitor)
    assert funcol.all_reduce is all_reduce  # nothing of torch stays wrapped after fit
    assert len(monitor.steps) == SPEC.steps - 1  # the warm-up step left out
    written = json.loads((tmp_path / "scaling.json").read_text())
    measured, predicted = written["measured"], written["predicted"]
    assert measured["steps"] == SPEC.steps - 1 and measured["samples_per_s"] > 0
    assert measured["compute_s"] == pytest.approx(measured["step_s"])  # one process: nothing to wait for
    assert predicted["layout"] == {**predicted["layout"], "dp": 1, "tp": 1, "pp": 1}
    assert predicted["memory_by_pipeline_rank"][0]["parameters"] > 0
    # A CPU's peak: the allocated bytes (what is predicted) and the resident set (glibc's cache too), the sampling
    # thread gone with the fit.
    assert 0 < measured["peak_memory_bytes"] and 0 < measured["resident_peak_bytes"]
    assert monitor._peak_memory._sampler is None


def test_disabled_monitor_does_nothing(tmp_path):
    monitor = ScalingMonitor(enabled=False, output_dir=tmp_path)
    fit_with(monitor)
    assert monitor.steps == [] and monitor.summary == {} and not (tmp_path / "scaling.json").exists()


def test_bad_arguments_and_nested_counting_are_refused():
    with pytest.raises(TypeError, match="enabled"):
        ScalingMonitor(enabled="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup_steps"):
        ScalingMonitor(warmup_steps=-1)
    first, second = DTensorCollectives(), DTensorCollectives()
    with first.active(), pytest.raises(RuntimeError, match="already counting"), second.active():
        pass


def test_a_collective_calling_another_is_counted_once(monkeypatch):
    # funcol's all_gather_tensor calls all_gather_single, which calls wait_tensor when it gathers along a dimension
    # other than 0: the nested calls must not add their seconds or bytes again (the exposed time exceeded the step).
    clock = [0.0]
    monkeypatch.setattr("lightning_parallel.measure.device_clock.time.perf_counter", lambda: clock[0])

    def wait_tensor(tensor):
        clock[0] += 1.0
        return tensor

    def all_gather_single(tensor, *args, **kwargs):
        clock[0] += 1.0
        return funcol.wait_tensor(tensor)

    monkeypatch.setattr(funcol, "wait_tensor", wait_tensor)
    monkeypatch.setattr(funcol, "all_gather_single", all_gather_single)
    monkeypatch.setattr(funcol, "all_gather_tensor", lambda tensor, *a, **k: funcol.all_gather_single(tensor, *a, **k))
    counter = DTensorCollectives()
    with counter.active():
        funcol.all_gather_tensor(torch.zeros(4, dtype=torch.float64), 1, None)
        funcol.wait_tensor(torch.zeros(1))
    assert counter.tally.as_dict() == {"calls": 1, "bytes": 32, "seconds": 3.0}


def test_scaling_plot_of_a_sweep(tmp_path):
    from lightning_parallel.observe.scaling_plot import main, scaling_points

    def run(world: int, samples_per_s: float, efficiency: float | None) -> dict:
        predicted = {"layout": {"dp": world, "tp": 1, "pp": 1}, "efficiency": efficiency} if efficiency else None
        return {"world_size": world, "measured": {"samples_per_s": samples_per_s}, "predicted": predicted}

    runs = [run(1, 100.0, 1.0), run(2, 180.0, 0.95), run(4, 300.0, 0.8)]
    measured, predicted = scaling_points(runs)
    assert measured == {"dp": [(1, 1.0), (2, 0.9), (4, 0.75)]}
    assert predicted == {"dp": [(1, 1.0), (2, 0.95), (4, 0.8)]}
    for index, summary in enumerate(runs):
        (tmp_path / str(index)).mkdir()
        (tmp_path / str(index) / "scaling.json").write_text(json.dumps(summary))
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "scaling.png").read_bytes().startswith(b"\x89PNG")
    (tmp_path / "0" / "scaling.json").unlink()  # no one-device run: nothing to measure speedup against
    assert main([str(tmp_path)]) == 2


def test_device_time_is_read_from_events_only_when_the_total_is_asked_for(monkeypatch):
    # On a GPU a collective or kernel returns once queued: intervals are CUDA events, read at a window's edge.
    from lightning_parallel.measure import device_clock

    synchronized = []

    class Event:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = len(recorded)
            recorded.append(self)

        def synchronize(self):
            synchronized.append(self)

        def elapsed_time(self, end):
            return 1000.0 * (end.at - self.at)  # milliseconds, as torch.cuda.Event's

    recorded: list = []
    monkeypatch.setattr(device_clock.torch.cuda, "Event", Event)
    clock = device_clock.DeviceClock("cuda")
    elapsed = device_clock.Elapsed()
    for _ in range(3):
        start = clock.mark()
        clock.mark()  # work queued in between
        elapsed.add(start, clock.mark())
    assert not synchronized  # nothing waited for inside the "step"
    assert elapsed.total == 6.0 and len(synchronized) == 3
    elapsed.reset()
    assert elapsed.total == 0.0
