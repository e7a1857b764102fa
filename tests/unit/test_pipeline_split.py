"""Pipeline configuration, schedules and split planning, checked in-process (nothing is launched)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightning_parallel import (
    SCHEDULES,
    ParallelLayout,
    PipelineParallelStrategy,
)
from lightning_parallel.parallelize.pipeline.build import check_split_points
from lightning_parallel.parallelize.pipeline.schedule import (
    check_schedule,
    stage_ranks,
    stages_on,
)
from lightning_parallel.parallelize.pipeline.split import (
    find_trunk,
    partition,
    plan_split,
)
from lightning_parallel.strategies.components.pipeline.microbatches import combine
from recipes.models.gpt import GPT


def small_gpt(n_layer: int = 4) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=64, block_size=8, n_layer=n_layer, n_head=2, n_embd=16, dropout=0.0, tie_weights=True)


def test_every_torch_schedule_has_a_name():
    from torch.distributed.pipelining import schedules

    provided = {name for name in dir(schedules) if name.startswith("Schedule") and name != "ScheduleForwardOnly"}
    assert {f"Schedule{spec.torch_name}" for spec in SCHEDULES.values()} == provided - {"Schedule"}


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"schedule": "zigzag"}, r"schedule='zigzag' is unknown; choose one of gpipe, 1f1b, interleaved_1f1b"),
        ({"schedule": "interleaved_1f1b"}, r"needs stages_per_rank >= 2 \(got 1\)"),
        ({"schedule": "1f1b", "stages_per_rank": 2}, r"runs one stage per rank, but stages_per_rank=2"),
        ({"schedule": "zbv_zero_bubble", "stages_per_rank": 3}, r"exactly 2 stages on each rank .* Set stages_per_rank=2"),
        ({"microbatches": 0}, r"microbatches=0 must be a positive int"),
        ({"balance": "flops"}, r"balance='flops' is unknown; choose one of params, time"),
        ({"split_points": "middle"}, r"split_points='middle': use 'auto' or a list of module names"),
    ],
)
def test_bad_pipeline_options_fail_at_construction(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        PipelineParallelStrategy(2, **kwargs)


def test_too_few_microbatches_for_the_schedule_fail_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"schedule='1f1b' with 4 stages needs at least 4 micro-batches per batch, but microbatches=2"):
        L.Trainer(strategy=PipelineParallelStrategy(4, microbatches=2), accelerator="cpu", devices=4, logger=False)
    with pytest.raises(ValueError, match=r"schedule='dualpipev' with 4 stages needs at least 4"):
        check_schedule("dualpipev", 2, 2, 2)


def test_pipeline_strategy_wiring():
    assert StrategyRegistry["pipeline_parallel"]["strategy"] is PipelineParallelStrategy
    trainer = L.Trainer(strategy=PipelineParallelStrategy(2, microbatches=2), accelerator="cpu", devices=4, logger=False)
    assert trainer.strategy.layout == ParallelLayout(data_parallel_size=2, pipeline_parallel_size=2)
    # Pipeline peers read the same batch: the sampler splits over data-parallel replicas only.
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    with pytest.raises(ValueError, match="sync_batchnorm=True is not supported with pipeline_parallel_size > 1"):
        L.Trainer(strategy=PipelineParallelStrategy(2, sync_batchnorm=True), accelerator="cpu", devices=2, logger=False)


def test_stage_placement_loop_and_v():
    assert stage_ranks(SCHEDULES["interleaved_1f1b"], 2, 4) == [0, 1, 0, 1]
    assert stage_ranks(SCHEDULES["zbv_zero_bubble"], 2, 4) == [0, 1, 1, 0]
    assert stages_on(stage_ranks(SCHEDULES["dualpipev"], 4, 8), 1) == [1, 6]


@pytest.mark.parametrize(
    ("costs", "parts", "starts"),
    [([1, 1, 1, 1], 2, [2]), ([5, 1, 1, 1, 1, 1], 2, [1]), ([1, 2, 3, 4, 5, 6], 3, [3, 5]), ([3, 3], 2, [1])],
)
def test_partition_minimises_the_largest_stage(costs, parts, starts):
    assert partition(costs, parts) == starts


def test_partition_needs_a_layer_per_stage():
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        partition([1, 1], 3)


def test_trunk_is_the_longest_layer_list():
    name, trunk = find_trunk(small_gpt())
    assert name == "blocks" and len(trunk) == 4
    with pytest.raises(ValueError, match="has no nn.ModuleList or nn.Sequential"):
        find_trunk(nn.Linear(2, 2))


class WithUnusedEncoder(nn.Module):
    """A text model beside a longer encoder that a text-only batch never runs (a multimodal model's audio tower)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(4, 4) for _ in range(6))
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_the_trunk_is_the_longest_layer_list_forward_runs():
    model = WithUnusedEncoder()
    assert find_trunk(model)[0] == "encoder"  # by structure alone
    plan = plan_split(model, 2, (torch.randn(2, 4),), {}, "params")
    assert plan.split_points == ("layers.1",) or plan.split_points == ("layers.2",)
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_parameter_balance_counts_embeddings_and_head_with_their_stages():
    model = small_gpt()
    idx = torch.randint(0, 64, (2, 8))
    plan = plan_split(model, 2, (idx,), {}, "params")
    assert plan.split_points == ("blocks.2",)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    embeddings = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    # The tied head weight is replicated onto the last stage, so it counts there too.
    head = model.ln_f.weight.numel() * 2 + model.lm_head.weight.numel()
    assert plan.stage_costs == (embeddings + 2 * block, 2 * block + head)
    assert "stage 1: from model.blocks.2" in plan.describe("model.")
    # Profiling leaves no trace: no gradients, same RNG stream.
    assert all(p.grad is None for p in model.parameters())


def test_split_of_a_meta_built_transformers_model():
    # empty_init=true: the pipeline is cut on a meta-built model and meta batch. transformers' mask helpers ask the
    # position ids for values ((...).all()) unless the model is being compiled; the split runs it as a trace does.
    pytest.importorskip("transformers")
    from recipes.models.transformers_lm import TransformersCausalLM

    config = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
    with torch.device("meta"):
        model = TransformersCausalLM("llama", vocab_size=64, block_size=16, config=config).model
    plan = plan_split(model, 2, (), {"input_ids": torch.randint(0, 64, (2, 16), device="meta"), "use_cache": False}, "params")
    assert plan.split_points == ("model.layers.2",)
    assert torch.compiler.is_compiling() is False  # restored


def test_time_balance_measures_every_layer():
    model = small_gpt()
    plan = plan_split(model, 4, (torch.randint(0, 64, (2, 8)),), {}, "time")
    assert len(plan.split_points) == 3 and all(cost > 0 for cost in plan.stage_costs)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"needs 4 stages but blocks has only 2 layers .* Lower pipeline_parallel_size × stages_per_rank"):
        plan_split(small_gpt(n_layer=2), 4, (torch.randint(0, 64, (2, 8)),), {}, "params")


def test_explicit_split_points_are_checked():
    model = small_gpt()
    check_split_points(model, ["blocks.2"], 2, "model")
    with pytest.raises(ValueError, match=r"split_points has 2 names but 2 stages need 1"):
        check_split_points(model, ["blocks.1", "blocks.2"], 2, "model")
    with pytest.raises(ValueError, match=r"split_points \['blocks.9'\] name no submodule of GPT .*e.g. model.blocks"):
        check_split_points(model, ["blocks.9"], 2, "model")


def test_micro_batch_results_combine_into_the_batch_result():
    losses = [torch.tensor(1.0), torch.tensor(4.0)]
    # Weighted by rows: a 3-row and a 1-row micro-batch.
    assert combine(losses, [3, 1]) == pytest.approx(1.75)
    combined = combine([{"loss": torch.tensor(2.0), "pred": torch.ones(3, 2)}, {"loss": torch.tensor(4.0), "pred": torch.zeros(1, 2)}], [3, 1])
    assert combined["loss"] == pytest.approx(2.5) and combined["pred"].shape == (4, 2)
    assert combine([None, None], [1, 1]) is None
