"""Deferred initialisation and weights_from in one process: eager values replayed, bad input refused."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_parallel.checkpoint.pretrained import load_pretrained
from lightning_parallel.parallelize.deferred_init import (
    InitialValues,
    allocate_local,
    parameters_on_meta,
    tied_aliases,
)
from lightning_parallel.strategies.components.placement import local_targets
from tests.harness import JobSpec, make_model

#: Models whose every random draw at construction is a reset_parameters() or an _init_weights (the contract).
REPLAYED = ["gpt", "view_attention", "hf_llama", "hf_qwen2", "hf_phi3", "hf_gpt_neox"]


class WithTable(nn.Module):
    """A layer and a buffer computed in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0))


def _built_on_meta(build) -> tuple[nn.Module, InitialValues]:
    with parameters_on_meta():
        module = build()
    values = InitialValues.of(module)
    allocate_local(module, torch.device("cpu"))
    return module, values


@pytest.mark.parametrize("model", REPLAYED)
def test_meta_built_model_gets_the_eager_initial_values(model):
    if model.startswith("hf_"):
        pytest.importorskip("transformers")
    spec = JobSpec(model=model)
    L.seed_everything(3)
    eager = make_model(spec)
    after_eager = torch.get_rng_state()
    L.seed_everything(3)
    module, values = _built_on_meta(lambda: make_model(spec))
    assert all(p.is_meta for p in values.skeleton.parameters())
    written = values.write(local_targets(module))
    assert set(written) >= {name for name, _ in module.named_parameters()}
    expected, actual = eager.state_dict(), module.state_dict()
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    # The generator ends where eager construction leaves it (dropout masks etc. follow in step).
    assert torch.equal(torch.get_rng_state(), after_eager)
    # Tied weights stay tied.
    assert tied_aliases(module) == tied_aliases(eager)


def test_buffers_are_built_and_parameters_are_not():
    with parameters_on_meta():
        module = WithTable()
    assert module.proj.weight.is_meta and not module.table.is_meta
    assert torch.equal(module.table, torch.arange(4.0))


def test_parameters_without_an_initialiser_are_refused():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = Scale()
            self.proj = nn.Linear(3, 3)

    with parameters_on_meta():
        module = Model()
    with pytest.raises(TypeError, match=r"define no reset_parameters.*scale \(Scale\)"):
        InitialValues.of(module)


def test_a_module_built_on_the_meta_device_with_its_buffers_is_refused():
    with torch.device("meta"):
        module = WithTable()
    with pytest.raises(RuntimeError, match=r"buffers .*table.* are on the meta device.*init_module\(empty_init=True\)"):
        InitialValues.of(module)


def test_weights_from_refuses_a_checkpoint_that_does_not_fit_before_reading_anything(tmp_path):
    source = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    state = source.state_dict()
    state["1.weight"] = torch.zeros(3, 8)  # mis-shaped
    del state["1.bias"]  # missing
    state["2.weight"] = torch.zeros(1)  # unexpected
    torch.save({"state_dict": state}, tmp_path / "wrong.ckpt")
    target = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in target.state_dict().items()}
    with pytest.raises(RuntimeError) as raised:
        load_pretrained(tmp_path / "wrong.ckpt", local_targets(target), None, whole_shapes=shapes)
    message = str(raised.value)
    assert "weights_from=" in message and "missing (1) ['1.bias']" in message and "unexpected (1) ['2.weight']" in message
    assert "1.weight: (3, 8) in the checkpoint vs (2, 8)" in message
    for name, value in target.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed although the checkpoint was refused"


def test_weights_from_finds_the_module_under_a_prefix_and_converts_dtype(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    inner = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    safetensors.save_file({k: v.contiguous() for k, v in inner.state_dict().items()}, tmp_path / "model.safetensors")

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).double()

    wrapper = Wrapper()
    shapes = {k: tuple(v.shape) for k, v in wrapper.state_dict().items()}
    written = load_pretrained(tmp_path, local_targets(wrapper), None, whole_shapes=shapes)
    assert sorted(written) == sorted(shapes)
    for name, value in inner.state_dict().items():
        assert wrapper.state_dict()[f"net.{name}"].dtype == torch.float64
        assert torch.equal(wrapper.state_dict()[f"net.{name}"], value.double())


def test_weights_from_tells_what_it_cannot_read(tmp_path):
    module = nn.Linear(2, 2)
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    with pytest.raises(FileNotFoundError, match="weights_from='.*missing'"):
        load_pretrained(tmp_path / "missing", local_targets(module), None, whole_shapes=shapes)
    (tmp_path / "a.safetensors").write_bytes(b"")
    (tmp_path / "b.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="2 .safetensors files and no model.safetensors.index.json"):
        load_pretrained(tmp_path, local_targets(module), None, whole_shapes=shapes)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="could not be read as a checkpoint file"):
        load_pretrained(tmp_path / "notes.txt", local_targets(module), None, whole_shapes=shapes)
