"""What the last pipeline stage shares each step: the structure once, then one byte tensor (no process group here:
the collectives are stood in for by a recording pair of ranks)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_parallel.strategies.components.pipeline import results as results_module
from lightning_parallel.strategies.components.pipeline.microbatches import combine_logs
from lightning_parallel.strategies.components.pipeline.results import (
    LastStageResults,
    ResultLayout,
)


def _step_results(loss: float, *, extra: bool = False) -> Any:
    output = {"loss": torch.tensor(loss, dtype=torch.float64), "lr": 0.1}
    logs = [
        ("train/loss", torch.tensor(loss, dtype=torch.float64), {"prog_bar": True, "sync_dist": True, "reduce_fx": torch.mean}),
        ("train/tokens", torch.tensor([3, 4], dtype=torch.int32), {}),
        ("train/ok", torch.tensor(True), {}),
        ("val/accuracy", ("__metric__", "val_accuracy"), {}),
    ]
    if extra:
        logs.append(("train/extra", torch.zeros(2, 3, dtype=torch.bfloat16), {}))
    return output, logs


def test_layout_round_trip_is_bitwise_and_keeps_the_constants():
    value = _step_results(1.25)
    layout, tensors = ResultLayout.of(value)
    assert layout.cacheable and layout.nbytes % 16 == 0
    buffer = layout.pack(tensors, torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and int(buffer[0]) == 0
    (output, logs) = layout.unpack(buffer)
    expected_output, expected_logs = value
    assert output["lr"] == 0.1 and torch.equal(output["loss"], expected_output["loss"])
    for (name, got, options), (_, want, want_options) in zip(logs, expected_logs):
        assert options == want_options, name
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want), name
        else:
            assert got == want
    # Another step with other values but the same structure matches; a new name, dtype or shape does not.
    assert ResultLayout.of(_step_results(7.0))[0].matches(layout)
    assert not ResultLayout.of(_step_results(7.0, extra=True))[0].matches(layout)
    assert not ResultLayout.of({"loss": torch.tensor(1.0, dtype=torch.float32), "lr": 0.1})[0].matches(ResultLayout.of(value[0])[0])
    assert not ResultLayout.of({"loss": torch.tensor(1.0, dtype=torch.float64), "lr": 0.2})[0].matches(ResultLayout.of(value[0])[0])


def test_an_object_leaf_is_not_cached():
    class Box:
        def __init__(self, t):
            self.t = t

    layout, _ = ResultLayout.of({"loss": torch.tensor(1.0), "box": Box(torch.ones(2))})
    assert not layout.cacheable and not layout.matches(layout)


class _Pair:
    """Two ranks of a pipeline group played in turn: rank 1 holds the last stage (the source)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.sent: list[Any] = []

    def broadcast(self, tensor, group=None, group_src=0):
        self.calls.append("broadcast")
        if self.source:
            self.sent.append(tensor.clone())
        else:
            tensor.copy_(self.sent.pop(0))
        return tensor

    def broadcast_object_list(self, objects, src=0, group=None):
        self.calls.append("broadcast_object_list")
        if self.source:
            self.sent.append(list(objects))
        else:
            objects[:] = self.sent.pop(0)
        return objects


def test_one_broadcast_per_step_once_the_structure_is_known(monkeypatch):
    pair = _Pair()
    monkeypatch.setattr(results_module, "collectives", pair)
    last = LastStageResults(None, 1, 1, True, torch.device("cpu"))
    other = LastStageResults(None, 1, 1, False, torch.device("cpu"))
    reads = []
    original_bool = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or original_bool(t))

    def step(value: Any) -> tuple[Any, list[str]]:
        pair.calls.clear()
        pair.source = True
        assert last.share("training_step", value) is value  # the last stage keeps its own results
        pair.source = False
        reads.clear()
        received = other.share("training_step", None)
        assert not pair.sent
        return received, list(pair.calls), len(reads)

    received, calls, host_reads = step(_step_results(1.0))
    assert calls == ["broadcast_object_list", "broadcast"] * 2 and host_reads == 0  # first step: the structure
    for loss in (2.0, 3.0):
        received, calls, host_reads = step(_step_results(loss))
        assert calls == ["broadcast"] * 2 and host_reads == 1  # one broadcast; the receiver reads one byte
        assert received[0]["loss"].item() == loss and received[1][0][1].item() == loss
    received, calls, _ = step(_step_results(4.0, extra=True))  # the structure changed: sent again, then the tensors
    assert calls == ["broadcast", "broadcast_object_list", "broadcast"] * 2
    assert received[1][-1][0] == "train/extra" and received[1][-1][1].dtype == torch.bfloat16
    received, calls, _ = step(_step_results(5.0, extra=True))
    assert calls == ["broadcast"] * 2 and received[0]["loss"].item() == 5.0


def test_combined_logs_stay_on_their_device():
    """No copy to the host per logged name (a device-to-host copy waits for the device): meta tensors stay meta."""
    logs = {j: [("a", torch.tensor(1.0, dtype=torch.float64, device="meta"), {})] for j in range(2)}
    ((name, value, _),) = combine_logs(logs, [1, 3], torch.nn.Module())
    assert name == "a" and value.device.type == "meta"
