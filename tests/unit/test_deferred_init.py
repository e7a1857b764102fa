"""Deferred initialisation and weights_from in one process: eager values replayed, bad input refused."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_parallel.checkpoint.pretrained import load_pretrained
from lightning_parallel.parallelize.placement.deferred_init import (
    InitialValues,
    allocate_local,
    parameters_on_meta,
    tied_aliases,
)
from lightning_parallel.strategies.components.placement import local_targets
from tests.harness import JobSpec, make_model

#: Models whose every random draw at construction is a reset_parameters() or an _init_weights (the contract); list_moe
#: and old_mixtral build layers in __init__ that they replace or delete.
REPLAYED = ["gpt", "gpt_moe", "hf_mixtral", "view_attention", "hand_norm_attention", "list_moe", "old_mixtral", "hf_llama", "hf_qwen2", "hf_phi3", "hf_gpt_neox"]


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


class RMSNorm(nn.Module):
    """As in Meta's reference Llama code: the parameter made in __init__, no reset_parameters()."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class Rotary(nn.Module):
    """A rope table from arange (a buffer) and learnt slopes derived from arange (a parameter)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self.register_buffer("cos", torch.outer(torch.arange(8, dtype=torch.float64), inv_freq).cos(), persistent=False)
        self.slopes = nn.Parameter(2 ** (-torch.arange(1, d + 1, dtype=torch.float32) / d))


class Drawn(nn.Module):
    """Parameters drawn in __init__ every common way, beside a layer that resets itself."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.randn(d, d) * 0.02)
        self.normal = nn.Parameter(torch.empty(d).normal_(0.0, 0.5))
        self.late = nn.Parameter(torch.empty(d, 2))
        nn.init.xavier_uniform_(self.late)  # after registration: on the meta parameter
        generator = torch.Generator().manual_seed(11)
        self.own_stream = nn.Parameter(torch.rand(d, generator=generator))
        self.through_data = nn.Parameter(torch.empty(d))
        self.through_data.data.normal_(0.0, 0.3)  # old GPT-2 style, through .data
        mask = torch.zeros(d)
        mask[0] = 1.0
        self.masked = nn.Parameter(mask)


class ScaledLinear(nn.Linear):
    """A layer with reset_parameters() and one more parameter that it does not set."""

    def __init__(self, d: int) -> None:
        super().__init__(d, d)
        self.scale = nn.Parameter(torch.full((d,), 0.5))


class HandWritten(nn.Module):
    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, d)
        self.norm = RMSNorm(d)
        self.rotary = Rotary(d)
        self.drawn = Drawn(d)
        self.scaled = ScaledLinear(d)
        self.head = nn.Linear(d, 8, bias=False)


def test_parameters_made_in_init_are_replayed_as_eager_construction_made_them():
    torch.manual_seed(5)
    eager = HandWritten()
    after_eager = torch.get_rng_state()
    torch.manual_seed(5)
    module, values = _built_on_meta(HandWritten)
    assert all(p.is_meta for p in values.skeleton.parameters())
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(5).get_state()), "the meta build left draws in the stream"
    torch.manual_seed(5)
    written = values.write(local_targets(module))
    assert set(written) >= {name for name, _ in module.named_parameters()}
    for name, expected in eager.state_dict().items():
        assert torch.equal(module.state_dict()[name], expected), name
    assert torch.equal(torch.get_rng_state(), after_eager)


def test_random_draws_outside_parameters_keep_the_stream_as_built():
    """The rule's limit: a buffer drawn at construction keeps its draws, so parameters drawn beside it are
    replayed after them (the same on every layout, not eager's)."""

    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("noise", torch.randn(3))
            self.gain = nn.Parameter(torch.randn(3))

    torch.manual_seed(2)
    eager = Noisy()
    gains = []
    for _ in range(2):
        torch.manual_seed(2)
        module, values = _built_on_meta(Noisy)
        assert torch.equal(module.noise, eager.noise)
        values.write(local_targets(module))
        gains.append(module.gain.detach().clone())
    assert torch.equal(gains[0], gains[1]) and not torch.equal(gains[0], eager.gain)


def test_one_value_parameters_fill_this_ranks_part_without_the_whole_tensor(monkeypatch):
    from lightning_parallel.parallelize.placement import deferred_init

    requested: list[int] = []
    tensors = deferred_init.HostScratch.tensors
    monkeypatch.setattr(deferred_init.HostScratch, "tensors", lambda self, like: requested.append(sum(t.numel() for t in like)) or tensors(self, like))
    module, values = _built_on_meta(lambda: nn.Sequential(RMSNorm(1000), Rotary(6)))
    target = module.state_dict(keep_vars=True)
    assert sorted(values.write(target)) == ["0.weight", "1.slopes"]
    assert torch.equal(module[0].weight, torch.ones(1000))
    # The constant is written in place; only the non-constant slopes (6 values) were materialised on the host.
    assert requested == [6, 6]  # the first pass and the copy-out of Rotary's unit


def test_a_creation_that_cannot_be_replayed_keeps_the_error():
    loaded = torch.ones(3)  # stands for values read from a file: no torch call made it during the build

    class FromFile(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(loaded.clone())

    class ThroughAView(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(3))
            with torch.no_grad():
                self.bias[0].fill_(2.0)  # changes part of the (meta) parameter through a view

    class ThroughNumpy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            values = torch.zeros(3)
            values.numpy()[0] = 5.0  # a change no torch call makes
            self.gain = nn.Parameter(values)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = FromFile()
            self.shift = ThroughAView()
            self.exposed = ThroughNumpy()
            self.norm = RMSNorm(3)  # replayable: not listed
            self.proj = nn.Linear(3, 3)

    with parameters_on_meta():
        module = Model()
    with pytest.raises(TypeError, match=r"define no reset_parameters.*cannot be replayed") as raised:
        InitialValues.of(module)
    message = str(raised.value)
    assert "scale.gain (FromFile): it uses a tensor of shape (3,) that no torch call made" in message
    assert "shift.bias (ThroughAView): it was changed in place through a view" in message
    assert "exposed.gain (ThroughNumpy): its memory was reached through numpy" in message
    assert "norm" not in message.split("device:")[1].split("Give")[0]


def test_a_module_with_nothing_recorded_keeps_the_error():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    module = nn.Sequential(Scale()).to("meta")  # parameters on meta, not built under parameters_on_meta
    with pytest.raises(TypeError, match=r"define no reset_parameters.*0\.gain \(Scale\): it was not made while the module was built"):
        InitialValues(module, {})


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


def _tiny_moe(transformers, family: str, seed: int):
    torch.manual_seed(seed)
    sizes = dict(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    config = (transformers.MixtralConfig(**sizes, num_local_experts=4) if family == "mixtral" else
              transformers.Qwen2MoeConfig(**sizes, num_experts=4, moe_intermediate_size=6,
                                          shared_expert_intermediate_size=10))
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_weights_from_a_per_expert_hugging_face_checkpoint_reads_the_fused_experts(tmp_path, family):
    """transformers 5 builds the experts fused (3-D) but saves them one module per expert, as the Hub keeps them
    (Mixtral also under another module name): weights_from converts through transformers' own mapping."""
    transformers = pytest.importorskip("transformers")
    saved = _tiny_moe(transformers, family, seed=0)
    saved.save_pretrained(tmp_path)
    model = _tiny_moe(transformers, family, seed=1)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    written = load_pretrained(tmp_path, local_targets(model), None, whole_shapes=shapes)
    assert sorted(written) == sorted(shapes)
    for name, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_ranks_slice_of_fused_experts_reads_only_its_experts_files(tmp_path):
    """Under expert parallelism a rank's experts are a dim-0 slice: only those experts' stored tensors are read."""
    transformers = pytest.importorskip("transformers")
    from lightning_parallel.checkpoint.expert_conversion import PerExpertSource
    from lightning_parallel.checkpoint.pretrained import _open_sliced

    saved = _tiny_moe(transformers, "mixtral", seed=0)
    saved.save_pretrained(tmp_path)
    stored = _open_sliced(tmp_path)
    read: list[str] = []
    original = stored.read
    stored.read = lambda name, index: read.append(name) or original(name, index)
    source = PerExpertSource.for_directory(tmp_path, stored)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert source.shapes()[name] == (4, 32, 8)
    part = source.read(name, (slice(2, 4), slice(0, 32), slice(0, 8)))
    assert torch.equal(part, saved.state_dict()[name][2:4])
    assert sorted(read) == [f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" for e in (2, 3) for w in ("w1", "w3")]


def test_weights_from_a_per_expert_checkpoint_without_its_config_says_how_to_load_it(tmp_path):
    """Without config.json the model type, and so transformers' mapping, is unknown: refused with the fix."""
    transformers = pytest.importorskip("transformers")
    model = _tiny_moe(transformers, "mixtral", seed=0)
    model.save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="stores each expert as a module of its own.*from_pretrained") as raised:
        load_pretrained(tmp_path, local_targets(model), None, whole_shapes=shapes)
    assert "experts.gate_up_proj" in str(raised.value) and "experts.0.w1.weight" in str(raised.value)


class Discarding(nn.Module):
    """Builds layers in ``__init__`` and throws them away (``del``, a replaced attribute, a temporary)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.dropped = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
        del self.dropped
        self.second = nn.Linear(4, 3)
        self.second = nn.Linear(4, 5)  # replaces the one just built
        nn.Linear(4, 4)  # a temporary, never attached
        self.third = nn.Linear(5, 2)


@pytest.mark.parametrize("build", [Discarding, lambda: nn.Sequential(Discarding(), nn.Linear(2, 2))])
def test_modules_discarded_in_init_draw_their_random_numbers_in_turn(build):
    """Eager construction drew the discarded layers' random numbers before the layers built after them: the replay
    draws them too, in the same place, so meta-built weights equal eager ones under the same seed."""
    torch.manual_seed(7)
    eager = build()
    after_eager = torch.get_rng_state()
    torch.manual_seed(7)
    module, values = _built_on_meta(build)
    torch.manual_seed(7)
    values.write(local_targets(module))
    for name, expected in eager.state_dict().items():
        assert torch.equal(module.state_dict()[name], expected), name
    assert torch.equal(torch.get_rng_state(), after_eager)


def test_a_layer_built_where_a_dropped_container_was_ends_when_it_ends():
    """A container attached then dropped frees its address; a layer built there later must not take its end (the
    order draws are replayed in): keyed by id(), a layer took the container's earlier end and two layers swapped."""
    from lightning_parallel.parallelize.placement.deferred_record import Construction

    construction = Construction()
    container = nn.Sequential()
    construction.attached(container)  # event 1
    address = id(container)
    del container
    kept = []
    for _ in range(10_000):
        layer = nn.Linear(1, 1)
        if id(layer) == address:
            break
        kept.append(layer)
    else:
        pytest.skip("the allocator never gave the container's address to a new layer")
    construction.registered(layer)  # event 2
    construction.attached(layer)  # event 3
    assert construction.position(layer) == 3
