"""Expert parallelism checked in-process: the layout's ep size, finding routed experts, refusals before launch,
and the dispatch/combine arithmetic on a one-rank group (the multi-rank runs are in test_transformers.py and the
coverage sample)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_parallel
from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallelize.expert.dispatch import dispatch_and_combine
from lightning_parallel.parallelize.expert.experts import (
    check_divisible,
    find_routed_experts,
    routed_experts,
)
from lightning_parallel.parallelize.common.expert_lists import ExpertList, find_expert_lists
from lightning_parallel.parallelize.expert.module_list import RemoteExpert, divide_expert_list


class Experts(nn.Module):
    """transformers' convention: 3-D experts called with the router's choices (Mixtral's eager forward)."""

    def __init__(self, num_experts: int = 4, hidden: int = 6, inner: int = 5) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * inner, hidden, dtype=torch.float64))
        self.down_proj = nn.Parameter(torch.randn(num_experts, hidden, inner, dtype=torch.float64))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for token, (experts, weights) in enumerate(zip(top_k_index, top_k_weights)):
            for expert, weight in zip(experts.tolist(), weights):
                if expert >= self.num_experts:
                    continue
                gate, up = (self.gate_up_proj[expert] @ hidden_states[token]).chunk(2)
                out[token] += weight * (self.down_proj[expert] @ (torch.nn.functional.silu(gate) * up))
        return out


# --- the layout ---------------------------------------------------------------------------------------------


def test_expert_parallel_size_divides_the_data_parallel_ranks_it_borrows():
    layout = ParallelLayout(data_parallel_size=-1, expert_parallel_size=2).resolve(4)
    assert layout.world_size == 4 and layout.expert_parallel_size == 2
    assert layout.describe() == "dp=4 × tp=1 × pp=1 (ep=2 of dp)"
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    assert ParallelLayout.from_dict({"pp": 1, "dp": 2, "tp": 1}).expert_parallel_size == 1  # older checkpoints
    with pytest.raises(ValueError, match=r"expert_parallel_size=4 must divide data_parallel_size=2.*borrows its ranks"):
        ParallelLayout(data_parallel_size=-1, tensor_parallel_size=2, expert_parallel_size=4).resolve(4)
    with pytest.raises(ValueError, match="expert_parallel_size=-1 is invalid"):
        ParallelLayout(expert_parallel_size=-1)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"sync": "local_sgd", "sync_every": 2}, "sync='local_sgd'"),
        ({"comm_hook": "fp16"}, "comm_hook='fp16'"),
    ],
)
def test_combinations_not_supported_yet_are_refused_before_launch(options, match):
    strategy = lightning_parallel.HybridParallelStrategy(data_parallel_size=-1, expert_parallel_size=2, **options)
    with pytest.raises(ValueError, match=f"expert_parallel_size=2 does not combine with {match} yet"):
        L.Trainer(accelerator="cpu", devices=8, strategy=strategy, logger=False)


@pytest.mark.parametrize("mode", ["shard", "hybrid_shard"])
def test_pipelines_of_sharded_data_parallelism_take_expert_parallelism(mode):
    """pp × ep × sharded dp (DeepSeek-V3's layout): each stage's dense parameters sharded, its experts divided."""
    shard_size = {"data_parallel_shard_size": 2} if mode == "hybrid_shard" else {}
    strategy = lightning_parallel.HybridParallelStrategy(
        data_parallel_size=-1, data_parallel_mode=mode, expert_parallel_size=2, pipeline_parallel_size=2, **shard_size
    )
    L.Trainer(accelerator="cpu", devices=8, strategy=strategy, logger=False)
    assert strategy.layout.expert_parallel_size == 2 and strategy.layout.pipeline_parallel_size == 2


@pytest.mark.parametrize("inside", ["tensor_parallel_size", "context_parallel_size"])
def test_pipelines_of_tensor_or_context_parallel_stages_take_expert_parallelism(inside):
    """dp2 ep2 × tp2 × pp2 (attention split over tp inside each stage) and dp2 ep2 × cp2 × pp2 (each stage's
    sequences split over cp): the stage's experts divided over ep."""
    strategy = lightning_parallel.HybridParallelStrategy(
        data_parallel_size=2, expert_parallel_size=2, pipeline_parallel_size=2, **{inside: 2}
    )
    L.Trainer(accelerator="cpu", devices=8, strategy=strategy, logger=False)
    assert strategy.layout.expert_parallel_size == 2 and getattr(strategy.layout, inside) == 2


def test_hydra_config_has_the_option():
    from omegaconf import OmegaConf

    from lightning_parallel.conf import CONFIG_DIR

    config = OmegaConf.load(CONFIG_DIR / "strategy" / "hybrid.yaml")
    assert config.expert_parallel_size == 1


# --- finding routed experts ---------------------------------------------------------------------------------


def test_routed_experts_are_found_with_their_expert_count_attributes():
    block = nn.ModuleDict({"gate": nn.Linear(6, 4), "experts": Experts()})
    found = find_routed_experts(block)
    assert list(found) == ["experts"]
    experts = found["experts"]
    assert experts.num_experts == 4 and set(experts.parameters) == {"gate_up_proj", "down_proj"}
    assert experts.count_attributes == ("num_experts",)
    with pytest.raises(ValueError, match=r"experts: its 4 experts are not divisible by expert_parallel_size=3"):
        check_divisible("experts", experts, 3)


def test_modules_expert_parallelism_cannot_divide_say_why():
    odd = Experts()
    odd.scale = nn.Parameter(torch.ones(3))  # not one entry per expert
    assert "scale [3] are not one entry per expert" in routed_experts(odd)
    nested = Experts()
    nested.post_expert_norm = nn.Module()
    nested.post_expert_norm.weight = nn.Parameter(torch.ones(4, 6))  # per expert, but in a submodule (Ergo)
    assert "submodules hold parameters (post_expert_norm.weight [4, 6])" in routed_experts(nested)
    assert routed_experts(Experts(num_experts=1)) is None  # a shared expert in the 3-D layout stays dense
    assert routed_experts(nn.Linear(4, 4)) is None
    # Experts as an nn.ModuleList of MLPs are not routed experts in transformers' layout (module_list.py's).
    block = nn.ModuleDict({"gate": nn.Linear(4, 4), "experts": nn.ModuleList([nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)) for _ in range(4)])})
    assert find_routed_experts(nn.ModuleDict({"layers": nn.ModuleList([block])})) == {}


# --- experts kept as an nn.ModuleList ------------------------------------------------------------------------


def test_module_list_experts_are_found_by_structure_beside_a_router():
    from tests.hf_models import ListMoELM, ViewAttentionLM

    found = find_expert_lists(ListMoELM())
    names = ("w1.weight", "w3.weight", "w2.weight")
    assert found == {f"layers.{i}.moe.experts": ExpertList(f"layers.{i}.moe", "experts", 4, names) for i in range(2)}
    assert found["layers.1.moe.experts"].parameter_names(range(2, 3)) == [f"layers.1.moe.experts.2.{n}" for n in names]
    # transformers 4.x's Mixtral block: the router is its gate.
    assert set(find_expert_lists(ListMoELM(old_mixtral=True))) == {"layers.0.moe.experts", "layers.1.moe.experts"}
    # A stack of identical layers is no MoE: no router beside it (whatever the list is called).
    assert find_expert_lists(ViewAttentionLM()) == {}
    # Children of other shapes, one child, or no parameters: not experts.
    router = nn.Linear(4, 3)
    odd = nn.ModuleDict({"router": router, "experts": nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 5)])})
    one = nn.ModuleDict({"router": nn.Linear(4, 1), "experts": nn.ModuleList([nn.Linear(4, 4)])})
    bare = nn.ModuleDict({"router": nn.Linear(4, 2), "experts": nn.ModuleList([nn.ReLU(), nn.ReLU()])})
    assert find_expert_lists(odd) == find_expert_lists(one) == find_expert_lists(bare) == {}


def _moe_and_copy(old_mixtral: bool = False):
    from tests.hf_models import ListMoE, OldMixtralBlock

    torch.manual_seed(0)
    block = (OldMixtralBlock if old_mixtral else ListMoE)(dim=6, hidden=5, experts=4).double()
    copy = (OldMixtralBlock if old_mixtral else ListMoE)(dim=6, hidden=5, experts=4).double()
    copy.load_state_dict(block.state_dict())
    return block, copy


@pytest.mark.parametrize("old_mixtral", [False, True], ids=["hand-written", "transformers-4-mixtral"])
def test_module_list_experts_two_pass_forward_equals_the_block_values_and_gradients(one_rank_group, old_mixtral):
    """Record, exchange (over one rank here: the multi-rank runs are in test_transformers.py) and replay give the
    block's own output and the gradients of its input, router and experts — including experts no token chose."""
    block, divided = _moe_and_copy(old_mixtral)
    model = nn.ModuleDict({"moe": divided})
    (listed,) = find_expert_lists(model).values()
    kept = divide_expert_list(model, listed, one_rank_group)
    assert len(kept) == 12 and not any(isinstance(e, RemoteExpert) for e in divided.experts)
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    x[:, :, 0] += 3  # skew the routing so that some expert gets no token
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    expected, got = first(block(a)), first(divided(b))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-13)
    expected.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-12)
    for (name, p), q in zip(block.named_parameters(), divided.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-12, msg=name)
    assert block.experts[0].w1.weight.grad is not None  # the router reached some experts ...


def test_module_list_experts_replay_refuses_a_forward_that_calls_other_experts(one_rank_group):
    from tests.hf_models import ListMoE

    class Restless(ListMoE):
        """Routes by fresh noise that does not come from torch's generator: the two passes disagree."""

        calls = 0

        def forward(self, x):
            Restless.calls += 1
            return self.experts[Restless.calls % 2](x[: Restless.calls])

    model = nn.ModuleDict({"moe": Restless(dim=6, hidden=5, experts=2).double()})
    divide_expert_list(model, next(iter(find_expert_lists(model).values())), one_rank_group)
    with pytest.raises(RuntimeError, match=r"expert 0 was called with input \[2, 6\] where the first pass recorded no call"):
        model["moe"](torch.randn(4, 6, dtype=torch.float64))


def test_module_list_experts_called_otherwise_are_refused(one_rank_group):
    from tests.hf_models import ListMoE

    class TwoArguments(ListMoE):
        def forward(self, x):
            return self.experts[0](x, x)

    model = nn.ModuleDict({"moe": TwoArguments(dim=6, hidden=5, experts=2).double()})
    divide_expert_list(model, next(iter(find_expert_lists(model).values())), one_rank_group)
    with pytest.raises(TypeError, match=r"must call an expert with one tensor of tokens \(experts\[0\]\(x\)\)"):
        model["moe"](torch.randn(4, 6, dtype=torch.float64))

    class Pairs(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(6, 6)

        def forward(self, x):
            return self.up(x), x

    class TupleExperts(ListMoE):
        def __init__(self):
            super().__init__(dim=6, hidden=5, experts=2)
            self.experts = nn.ModuleList([Pairs(), Pairs()])

        def forward(self, x):
            return self.experts[1](x)[0]

    model = nn.ModuleDict({"moe": TupleExperts().double()})
    divide_expert_list(model, next(iter(find_expert_lists(model).values())), one_rank_group)
    with pytest.raises(TypeError, match=r"exchanges each expert's output as one tensor, but Pairs returned tuple"):
        model["moe"](torch.randn(4, 6, dtype=torch.float64))


def test_remote_experts_hold_nothing_and_refuse_direct_calls():
    remote = RemoteExpert(3, 1)
    assert list(remote.parameters()) == [] and remote.state_dict() == {}
    with pytest.raises(RuntimeError, match="Expert 3 is held by expert-parallel rank 1: it can only be called from its MoE block"):
        remote(torch.zeros(2, 4))


# --- dispatch and combine -----------------------------------------------------------------------------------


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_dispatch_and_combine_equal_the_experts_own_forward_values_and_gradients(one_rank_group):
    torch.manual_seed(0)
    experts = Experts()
    hidden = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    weights, index = logits.softmax(-1).topk(2, dim=-1)
    index = index.clone()
    index[3, 1] = 4  # transformers' sentinel: no expert, contributes nothing

    expected = experts(hidden, index, weights)
    expected_grads = torch.autograd.grad(expected.square().sum(), (hidden, logits, experts.gate_up_proj), retain_graph=True)

    def run_local(tokens, local_index, ones):
        assert local_index.shape == (tokens.shape[0], 1) and torch.equal(ones, torch.ones_like(ones))
        return experts(tokens, local_index, ones)

    got = dispatch_and_combine(run_local, hidden, index, weights, 4, one_rank_group)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    got_grads = torch.autograd.grad(got.square().sum(), (hidden, logits, experts.gate_up_proj))
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_load_balancing_losses_are_found_where_the_model_calls_them():
    """Every transformers MoE modeling module of the model is taken (its loss is made global when called); a
    loss function of another signature, asked for by the config, is refused by name."""
    import sys
    import types
    from types import SimpleNamespace

    pytest.importorskip("transformers")
    from lightning_parallel.parallelize.expert.load_balancing import load_balancing_modules
    from tests.hf_models import RouterLossLM

    found = load_balancing_modules(RouterLossLM())
    assert [m.__name__ for m in found] == ["transformers.models.mixtral.modeling_mixtral"]
    assert load_balancing_modules(nn.Linear(2, 2)) == []

    other = types.ModuleType("other_moe_modeling")
    other.load_balancing_loss_func = lambda router_probs, expert_indices: 0.0  # switch-transformers' signature
    sys.modules[other.__name__] = other
    try:
        net = type("OtherMoE", (nn.Module,), {"__module__": other.__name__})()
        net.config = SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.01)
        with pytest.raises(ValueError, match=r"OtherMoE.*output_router_logits=True.*cannot be made global.*router_aux_loss_coef=0"):
            load_balancing_modules(net)
        net.config.router_aux_loss_coef = 0.0  # the logits are returned but nothing is added to the loss
        assert load_balancing_modules(net) == []
    finally:
        del sys.modules[other.__name__]


def test_experts_are_called_positionally_whatever_their_implementation_names_the_arguments(one_rank_group):
    """transformers' @use_experts_implementation dispatches the class's forward (gpt-oss: router_indices,
    routing_weights) to an implementation naming them top_k_index, top_k_weights: the local call must not use
    the class's names."""
    import functools

    from torch.distributed.device_mesh import init_device_mesh

    from lightning_parallel.parallelize.expert.experts import shard_experts

    def implementation(self, hidden_states, top_k_index, top_k_weights):
        return Experts.forward(self, hidden_states, top_k_index, top_k_weights)

    class Renamed(Experts):
        def forward(self, hidden_states, router_indices=None, routing_weights=None):
            raise AssertionError("the implementation runs instead")

        forward = functools.wraps(forward)(lambda self, *args, **kwargs: implementation(self, *args, **kwargs))

    torch.manual_seed(0)
    module = Renamed()
    hidden = torch.randn(5, 6, dtype=torch.float64)
    weights, index = torch.randn(5, 4, dtype=torch.float64).softmax(-1).topk(2, dim=-1)
    expected = module(hidden, index, weights)  # as gpt-oss's block calls its experts
    shard_experts("experts", module, routed_experts(module), init_device_mesh("cpu", (1,)))
    torch.testing.assert_close(module(hidden, index, weights), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ({"expert_parallel_size": 3, "data_parallel_size": 3}, "its 4 experts are not divisible by expert_parallel_size=3"),
        ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, "inside pipelines without tensor or context parallelism"),
    ],
)
def test_module_list_experts_refuse_what_they_do_not_combine_with(sizes, match):
    from types import SimpleNamespace

    from lightning_parallel.strategies.components.expert import ExpertParallelComponent
    from tests.hf_models import ListMoELM

    model = ListMoELM()
    layout = ParallelLayout(**{"data_parallel_size": 2, "expert_parallel_size": 2, **sizes})
    component = ExpertParallelComponent(SimpleNamespace(layout=layout, lightning_module=model))
    with pytest.raises(ValueError, match=match):
        component._check_lists(find_expert_lists(model))
    # Inside pipelines too: each stage's lists are divided after the cut, each MoE block an opaque operator.
    pipelined = ParallelLayout(data_parallel_size=2, expert_parallel_size=2, pipeline_parallel_size=2)
    ExpertParallelComponent(SimpleNamespace(layout=pipelined, lightning_module=model))._check_lists(find_expert_lists(model))
    with torch.device("meta"):
        on_meta = ListMoELM()
    ok = ExpertParallelComponent(SimpleNamespace(layout=ParallelLayout(data_parallel_size=2, expert_parallel_size=2), lightning_module=on_meta))
    with pytest.raises(ValueError, match=r"layers.0.moe.experts: experts kept as an nn.ModuleList cannot be divided while on the meta device"):
        ok._check_lists(find_expert_lists(on_meta))


def test_tensor_parallel_plan_leaves_module_list_experts_to_expert_parallelism():
    """Under ep × tp the automatic plan splits attention and dense MLPs but leaves the nn.ModuleList experts (MLPs
    below the excluded list) and everything else below an excluded module whole; without ep it splits each expert."""
    from lightning_parallel.parallelize.tensor.inference import infer_units
    from tests.hf_models import ListMoELM

    model = ListMoELM()
    lists = find_expert_lists(model)
    split = {fqn for unit in infer_units(model) for fqn in unit}
    left = {fqn for unit in infer_units(model, exclude=tuple(lists)) for fqn in unit}
    assert {"layers.0.moe.experts.1.w1", "layers.1.moe.experts.3.w2"} <= split
    assert not any(fqn.startswith(tuple(f"{fqn}." for fqn in lists)) for fqn in left)
    assert {"layers.0.attention.wq", "layers.1.attention.wo"} <= left and left == {
        fqn for fqn in split if ".experts." not in fqn}
    # An excluded block: nothing below it is split, the rest is.
    below = {fqn for unit in infer_units(model, exclude=("layers.0",)) for fqn in unit}
    assert not any(fqn.startswith("layers.0.") for fqn in below) and "layers.1.attention.wq" in below


def test_module_list_experts_rank_without_tokens_still_exchanges(one_rank_group):
    """A rank whose block calls no expert (no token here) still runs both exchanges, forward and backward (its
    peers wait for it there), and its output keeps the gradient path to the block's input."""
    _, divided = _moe_and_copy()
    model = nn.ModuleDict({"moe": divided})
    divide_expert_list(model, next(iter(find_expert_lists(model).values())), one_rank_group)
    x = torch.zeros(0, 6, dtype=torch.float64, requires_grad=True)
    out = model["moe"](x)
    assert out.shape == (0, 6) and out.requires_grad
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 6)
