"""Hugging Face transformers language models under every layout, against single-device training (float64).

Models are built from tiny configs in the test (nothing downloaded) and wrapped in an ordinary
LightningModule whose ``forward`` calls ``self.net(input_ids=x).logits`` (``tests/hf_models.py``). Every cell runs
what users run: transformers' default attention (SDPA; eager attention has a column of its own), four blocks
(two per pipeline stage), more micro-batches than stages, and validation batches of another size than training's. The matrix below is also what the README's
"Works with" table is generated from (``python -m tests.works_with``), so the two cannot drift.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch

from tests.distributed.test_data_parallel import TOL, assert_same_training
from tests.harness import JobSpec, run_distributed_jobs, run_job
from tests.hf_models import FAMILIES, MOE_FAMILIES, make_hf_model

pytestmark = pytest.mark.distributed

pytest.importorskip("transformers")

STEPS = 3
BATCH = 8  # per data-parallel replica
VAL_BATCH = 4  # per replica: not the training batch size
MICROBATCHES = {"microbatches": 4}  # more micro-batches than stages

#: layout name -> (ranks, data-parallel size, strategy, strategy options)
LAYOUTS: dict[str, tuple[int, int, str, dict]] = {
    "dp2": (2, 2, "data", {}),
    "tp2": (2, 1, "tensor", {}),
    # transformers' eager attention (the softmax written out) instead of the default SDPA.
    "tp2 eager": (2, 1, "tensor", {}),
    "tp2+sp": (2, 1, "tensor", {"sequence_parallel": True}),
    "pp2": (2, 1, "pipeline", MICROBATCHES),
    "tp2×pp2": (4, 1, "hybrid", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, **MICROBATCHES}),
    # Each stage's state sharded over its 2 replicas (FSDP2 inside the pipeline).
    "dp2-shard×pp2": (4, 2, "hybrid", {"data_parallel_size": 2, "data_parallel_mode": "shard", "pipeline_parallel_size": 2, **MICROBATCHES}),
    # FSDP2 over tensor-parallel shards with sequence parallelism (a fused q|k|v and a tied head split inside FSDP).
    "dp2-shard×tp2+sp": (4, 2, "hybrid", {"data_parallel_size": 2, "data_parallel_mode": "shard", "tensor_parallel_size": 2,
                                         "sequence_parallel": True}),
    "dp2×tp2×pp2": (8, 2, "hybrid", {"data_parallel_size": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, **MICROBATCHES}),
    # Context parallelism (eager attention is refused: it would attend within each rank's part only).
    "cp2": (2, 1, "hybrid", {"context_parallel_size": 2, "data_parallel_size": 1}),
    # ... inside a pipeline: each stage's attention a ring over the cp ranks (issue 28).
    "cp2×pp2": (4, 1, "hybrid", {"context_parallel_size": 2, "data_parallel_size": 1, "pipeline_parallel_size": 2, **MICROBATCHES}),
    # Expert parallelism borrows data-parallel ranks: 2 ranks each holding half the experts; 4 ranks as 2 groups of 2.
    "dp2 ep2": (2, 2, "hybrid", {"data_parallel_size": 2, "expert_parallel_size": 2}),
    # ... with the dense parameters sharded (FSDP2) and the experts divided.
    "dp2-shard ep2": (2, 2, "hybrid", {"data_parallel_size": 2, "expert_parallel_size": 2, "data_parallel_mode": "shard"}),
    "dp4 ep2": (4, 4, "hybrid", {"data_parallel_size": 4, "expert_parallel_size": 2}),
    # ... with attention and dense MLPs split over tp as usual, the experts divided over ep (left out of the tp plan).
    "dp2 ep2×tp2": (4, 2, "hybrid", {"data_parallel_size": 2, "expert_parallel_size": 2, "tensor_parallel_size": 2}),
    # ... inside a pipeline (each stage's experts divided over its ep peers; the experts call an opaque operator
    # in the traced stages) and beside context parallelism (each rank's part of the sequences routed).
    "dp2 ep2×pp2": (4, 2, "hybrid", {"data_parallel_size": 2, "expert_parallel_size": 2, "pipeline_parallel_size": 2, **MICROBATCHES}),
    "dp2 ep2×cp2": (4, 2, "hybrid", {"data_parallel_size": 2, "expert_parallel_size": 2, "context_parallel_size": 2}),
    # ... inside pipelines whose stages split attention over tp (the stage's experts divided over ep, left out of the
    # tp plan: each tp rank runs its ep rank's experts whole).
    "dp2 ep2×tp2×pp2": (8, 2, "hybrid", {"data_parallel_size": 2, "expert_parallel_size": 2, "tensor_parallel_size": 2,
                                        "pipeline_parallel_size": 2, **MICROBATCHES}),
}
#: Lightning's demo encoder–decoder (``nn.Transformer``), and a hand-written Llama-style LM whose attention
#: splits heads with ``view(B, L, self.n_heads, -1)``, next to the transformers families.
DEMO = "demo_transformer"
VIEW = "view_attention"
#: Meta's reference Llama as a user writes it (its own RMSNorm, MLP in a module of its own, no GQA):
#: the module issue 15 named, once refused under tp2 × pp2.
REF = "llama_reference"
#: The recipe GPT with a Mixture-of-Experts layer in each block (our own module in transformers' experts layout).
GPT_MOE = "gpt_moe"
#: Mixtral trained with its load-balancing loss (``output_router_logits=True``), made the global batch's.
ROUTER_LOSS = "router_loss_mixtral"
#: Experts kept as an nn.ModuleList of MLPs in the MoE block's own loop: a hand-written MoE (softmax top-2 over
#: SwiGLU experts, experts no token chose skipped), and transformers 4.x's Mixtral block written out.
LIST_MOE = ("list_moe", "old_mixtral")
#: Mixture-of-experts families (fused 3-D experts; Qwen2-MoE with a gated shared expert).
MOE = (*MOE_FAMILIES, GPT_MOE)
#: Which family runs under which layout (8 ranks on 2 cores are slow: two families, one of them fused).
MATRIX: dict[str, tuple[str, ...]] = {
    "dp2": (*FAMILIES, DEMO),
    # The demo's embedding, feed-forwards and head split; its nn.MultiheadAttention stays whole (SHARES).
    "tp2": (*FAMILIES, VIEW, REF, *MOE_FAMILIES, DEMO),
    "tp2 eager": tuple(FAMILIES),
    "tp2+sp": ("llama", "gpt2", "phi3"),
    # Mixtral's eager experts loop over the experts hit: opaque to the trace (list_moe: the whole block, loop included).
    "pp2": (*FAMILIES, VIEW, REF, "mixtral", "list_moe"),
    "tp2×pp2": (*FAMILIES, VIEW, REF, "list_moe"),  # list_moe: each tp rank runs its MoE blocks' operators whole
    "dp2×tp2×pp2": ("phi3",),  # fused q|k|v and gate|up (qwen2 runs tp2×pp2 on 4 ranks): 8 ranks are slow
    "dp2-shard×pp2": ("llama", "gpt2"),
    "dp2-shard×tp2+sp": ("gpt2",),
    "cp2": (*FAMILIES, VIEW),
    "cp2×pp2": ("llama", "phi3"),
    "dp2 ep2": (*MOE, ROUTER_LOSS, *LIST_MOE),
    "dp2-shard ep2": ("mixtral", "list_moe"),
    "dp4 ep2": ("qwen2_moe",),
    "dp2 ep2×tp2": ("qwen2_moe", "list_moe"),
    "dp2 ep2×pp2": ("mixtral", "list_moe"),
    "dp2 ep2×cp2": ("qwen2_moe", "list_moe"),
    "dp2 ep2×tp2×pp2": ("mixtral",),
}
#: Layouts the library refuses for a family: each runs in its layout's launch like every other cell
#: (``JobSpec.expect_refusal``) and its error must name the cause -> (the README's words, a line of the error).
REFUSED: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    # nn.Transformer checks its masks with data-dependent Python branches, which torch.export cannot trace.
    (DEMO, "pp2"): ("not traceable", ("Pipeline parallelism could not trace DemoTransformer.forward", "Make forward traceable")),
    (DEMO, "tp2×pp2"): ("not traceable", ("Pipeline parallelism could not trace DemoTransformer.forward", "Make forward traceable")),
    (DEMO, "dp2×tp2×pp2"): ("not traceable", ("Pipeline parallelism could not trace DemoTransformer.forward", "Make forward traceable")),
    # nn.MultiheadAttention computes its attention without F.scaled_dot_product_attention here (it returns the
    # weights): ring attention would never run, so the first batch refuses instead of attending within a part.
    (DEMO, "cp2"): ("attention not through SDPA", ("DemoTransformer made no F.scaled_dot_product_attention call under context parallelism",
                                                   "context_parallel_size=1")),
}
#: Trained cells whose largest rank holds more than 0.6 of the parameters, with that share (checked within 0.01):
#: what the README's table shows beside the cell. Every other tp2 cell of the table holds at most 0.6.
SHARES = {(DEMO, "tp2"): 0.73}
#: Jobs that also accumulate two micro-batches per step (the reference then takes twice the batch).
ACCUMULATE = {("list_moe", "dp2 ep2"), ("list_moe", "dp2 ep2×tp2"), ("llama", "tp2"), ("gpt2", "pp2"), ("phi3", "tp2×pp2"), ("mixtral", "dp2 ep2"), ("qwen2_moe", "dp4 ep2"),
              ("mixtral", "dp2-shard ep2"), ("gpt2", "dp2-shard×pp2"), ("phi3", "cp2×pp2"), ("mixtral", "dp2 ep2×pp2"), ("list_moe", "dp2 ep2×pp2"),
              ("gpt2", "dp2-shard×tp2+sp"), ("mixtral", "dp2 ep2×tp2×pp2")}
#: Jobs that clip the gradient norm (the reference clips the same): nn.ModuleList experts divided over ep hold other
#: experts on each rank, whose shares of the norm are summed over the ep group.
CLIP = {("list_moe", "dp2 ep2"): 0.5}
#: TP jobs that save a checkpoint (in this format), wipe the weights and validate from it (fused layers, Conv1D, GQA).
ROUND_TRIP = {("list_moe", "dp2 ep2"): "full", ("old_mixtral", "dp2 ep2"): "sharded", ("gpt2", "tp2"): "full", ("phi3", "tp2"): "sharded", ("llama", "tp2"): "sharded",
              ("mixtral", "dp2 ep2"): "full", ("qwen2_moe", "dp2 ep2"): "sharded", ("llama", "dp2-shard×pp2"): "full",
              ("gpt2", "dp2-shard×tp2+sp"): "sharded"}


def blocks(family: str, layout: str) -> int:
    """Blocks of the hand-written models (the transformers families have four): the ModuleList MoE gets four under
    pipelines, two MoE blocks per stage (each block one opaque operator in the trace)."""
    return 4 if family in LIST_MOE and "pp" in layout else 2


def model_name(family: str, layout: str = "") -> str:
    if family in (DEMO, VIEW, REF, GPT_MOE, ROUTER_LOSS, *LIST_MOE):
        return family
    return f"hf_{family}:eager" if layout.endswith("eager") else f"hf_{family}"


def job(family: str, layout: str) -> JobSpec:
    devices, _, strategy, options = LAYOUTS[layout]
    return JobSpec(
        expect_refusal=(family, layout) in REFUSED,
        model=model_name(family, layout), strategy=strategy, devices=devices, batch_size=BATCH, val_batch_size=VAL_BATCH,
        accumulate=2 if (family, layout) in ACCUMULATE else 1, steps=STEPS, validate=True, gradient_clip_val=CLIP.get((family, layout)),
        n_layer=blocks(family, layout),
        checkpoint_round_trip=(family, layout) in ROUND_TRIP,
        # Pipelines see Lightning's sanity check first: a validation batch (4 rows) builds them, and the
        # first training batch (8 rows) must get stages of its own shape, not padding.
        sanity_val_steps=1 if "pp" in layout else 0,
        strategy_kwargs={"timeout": 120, "save_format": ROUND_TRIP.get((family, layout), "sharded"), **options},
    )


@cache
def reference(family: str, dp: int, accumulate: int, layout: str = "", clip: float | None = None, n_layer: int = 2) -> dict:
    """Single-device training of the same global batch (with the attention implementation the layout uses)."""
    return run_job(
        JobSpec(model=model_name(family, layout), batch_size=BATCH * dp * accumulate, val_batch_size=VAL_BATCH * dp,
                steps=STEPS, validate=True, gradient_clip_val=clip, n_layer=n_layer)
    )


def assert_matches_single_device(family: str, layout: str, result: dict) -> None:
    _, dp, _, _ = LAYOUTS[layout]
    accumulate = 2 if (family, layout) in ACCUMULATE else 1
    expected = reference(family, dp, accumulate, "eager" if layout.endswith("eager") else "", CLIP.get((family, layout)),
                         blocks(family, layout))
    assert_same_training(expected, result, steps=STEPS)
    if "pp" in layout:  # built on a sanity-check batch of 4 rows, traced again for training's 8
        assert result["pipeline_training_rows"] == BATCH, (family, layout)
    for key in expected["validation"]:
        assert result["validation"][key] == pytest.approx(expected["validation"][key], abs=TOL), (family, layout, key)


def cells_of(layouts: tuple[str, ...]) -> list[tuple[str, str]]:
    """Every (family, layout) cell of these layouts that runs: trained (:data:`MATRIX`) or refused (:data:`REFUSED`)."""
    return [(family, layout) for layout in layouts for family in (*MATRIX[layout], *(f for f, l in REFUSED if l == layout))]


def specs_of(layouts: tuple[str, ...]) -> dict[str, JobSpec]:
    """Every (family, layout) job of these layouts, by job name."""
    return {f"{family}-{layout}": job(family, layout) for family, layout in cells_of(layouts)}


def by_cell(results: dict[str, dict], layouts: tuple[str, ...]) -> dict[tuple[str, str], dict]:
    """The jobs' results of these layouts by (family, layout)."""
    return {(family, layout): results[f"{family}-{layout}"] for family, layout in cells_of(layouts)}


def assert_cell(family: str, layout: str, result: dict) -> bool:
    """A refused cell was refused with its message (False: nothing more to check); any other matches one device."""
    if (family, layout) in REFUSED:
        _, lines = REFUSED[family, layout]
        assert "refused" in result, f"{family} {layout} trained: move it from REFUSED to MATRIX (and check it)"
        assert all(line in result["refused"]["message"] for line in lines), (family, layout, result["refused"])
        return False
    assert "refused" not in result, (family, layout, result.get("refused"))
    assert_matches_single_device(family, layout, result)
    return True


def largest_share(result: dict, names: object = None) -> float:
    """The parameters (of ``names``, default all) held by the rank holding the most: every rank's, not rank 0's."""
    return max(sum(n for name, n in local.items() if names is None or name in names) for local in result["local_numel_by_rank"])


def run_layout(layouts: tuple[str, ...], tmp_path) -> dict[tuple[str, str], dict]:
    """Every (family, layout) job of these layouts (one world size) in one launch."""
    return by_cell(run_distributed_jobs(specs_of(layouts), tmp_path, timeout=900), layouts)


def test_two_ranks_dp_tp_pp_cp(tmp_path):
    results = run_layout(("dp2", "tp2", "tp2 eager", "tp2+sp", "pp2", "cp2", "dp2 ep2", "dp2-shard ep2"), tmp_path)
    trained = {cell: result for cell, result in results.items() if assert_cell(*cell, result)}
    for (family, layout), result in trained.items():
        if "ep" in layout:
            assert_experts_divided(family, result, ranks=2, dense_sharded="shard" in layout or "tp" in layout)
    for family in MATRIX["tp2"]:
        share = largest_share(trained[(family, "tp2")]) / sum(t.numel() for t in reference(family, 1, 1)["grads"][0].values())
        if (family, "tp2") in SHARES:  # what the README says beside the cell
            assert share == pytest.approx(SHARES[family, "tp2"], abs=0.01), (family, share)
        else:  # every other family splits its attention (fused or not) and MLP: well under the whole model on every rank
            assert share <= 0.6, f"{family}: a rank holds {share:.2f} of the parameters under tp2"
    assert_round_trips_load_into_the_plain_model(trained, tmp_path)


def assert_round_trips_load_into_the_plain_model(results: dict[tuple[str, str], dict], tmp_path) -> None:
    for family, layout in ROUND_TRIP:
        if (family, layout) in results:
            assert_checkpoint_loads_into_the_plain_model(family, tmp_path / f"{family}-{layout}" / "final.ckpt", results[(family, layout)],
                                                         clip=CLIP.get((family, layout)))


#: A fused projection and a Conv1D MLP weight held by rank 0 (first stage) under tp2×pp2.
SPLIT_IN_STAGES = {
    "gpt2": ("net.transformer.h.0.attn.c_attn.weight", "net.transformer.h.0.mlp.c_fc.weight"),
    "phi3": ("net.model.layers.0.self_attn.qkv_proj.weight", "net.model.layers.0.mlp.gate_up_proj.weight"),
}


FOUR_RANK_LAYOUTS = ("tp2×pp2", "dp2-shard×pp2", "dp2-shard×tp2+sp", "cp2×pp2", "dp4 ep2", "dp2 ep2×tp2", "dp2 ep2×pp2", "dp2 ep2×cp2")


def four_rank_specs() -> dict[str, JobSpec]:
    """This module's 4-rank jobs (run in the suite's one 4-rank launch, ``conftest.four_rank_launch``)."""
    return specs_of(FOUR_RANK_LAYOUTS)


def test_four_ranks_tp_pp(four_rank_launch):
    launched, _, root = four_rank_launch
    trained = {cell: result for cell, result in by_cell(launched, FOUR_RANK_LAYOUTS).items() if assert_cell(*cell, result)}
    assert_round_trips_load_into_the_plain_model(trained, root)
    for (family, layout), result in trained.items():
        if "ep" in layout:
            assert_experts_divided(family, result, ranks=2, dense_sharded="tp" in layout, pipelined="pp" in layout,
                                   layers=blocks(family, layout))
        whole = reference(family, 1, 2 if (family, layout) in ACCUMULATE else 1)["grads"][0]
        for name in SPLIT_IN_STAGES.get(family, ()) if "tp" in layout else ():
            # Fused and Conv1D layers are split inside pipeline stages too (half of each per TP rank), and FSDP2
            # shards each rank's half again: on every rank of the stage holding them.
            parts = 4 if "shard" in layout else 2
            assert holders(result, name) == [whole[name].numel() // parts] * (4 if "shard" in layout else 2), (family, layout, name)
        if (family, layout) == ("gpt2", "dp2-shard×tp2+sp"):
            # The tied embedding and head: one tensor, split over the vocabulary by tp and sharded by FSDP2.
            name = "net.transformer.wte.weight"
            assert holders(result, name) == [whole[name].numel() // 4] * 4, holders(result, name)


EIGHT_RANK_LAYOUTS = ("dp2×tp2×pp2", "dp2 ep2×tp2×pp2")


def eight_rank_specs() -> dict[str, JobSpec]:
    """This module's 8-rank jobs (run in the suite's one 8-rank launch, ``conftest.eight_rank_launch``)."""
    return specs_of(EIGHT_RANK_LAYOUTS)


def test_eight_ranks_dp_tp_pp(eight_rank_launch):
    for (family, layout), result in by_cell(eight_rank_launch[0], EIGHT_RANK_LAYOUTS).items():
        if assert_cell(family, layout, result) and "ep" in layout:
            # Half of each expert tensor (ep), attention split over tp, of the first stage's blocks (4 ranks).
            assert_experts_divided(family, result, ranks=2, dense_sharded=True, pipelined=True)
            query = "net.model.layers.0.self_attn.q_proj.weight"
            assert holders(result, query) == [reference(family, 1, 1)["grads"][0][query].numel() // 2] * 4, holders(result, query)


def assert_experts_divided(family: str, result: dict, ranks: int, dense_sharded: bool = False, pipelined: bool = False,
                           layers: int = 2) -> None:
    """Each rank holds 1/ranks of every routed-experts parameter (by expert index) and all of everything else
    (``dense_sharded``: dense parameters may be split by FSDP2 or tensor parallelism; ``pipelined``: of its
    pipeline stage only, the first)."""
    whole = reference(family, 1, 1, n_layer=layers)["grads"][0]
    if family in LIST_MOE:  # rank 0 holds experts 0 .. E/ranks - 1 of each block whole, and no other
        held = {name for name in whole if ".experts." in name and int(name.split(".experts.")[1].split(".")[0]) < 4 // ranks}
        expected = {name for name in whole if ".experts." not in name} | held
        if pipelined:  # of the blocks of its stage (the first half), and the embedding before them
            expected = {name for name in expected if not name.startswith("layers.") or int(name.split(".")[1]) < layers // 2}
            expected -= {"norm.weight", "output.weight"}
        assert set(result["local_numel"]) == expected, family
        assert all(result["local_numel"][name] == whole[name].numel() for name in held & expected), family
        return
    experts = [name for name in whole if ".experts." in name]
    assert experts and any(name in result["local_numel"] for name in experts), family
    if pipelined:
        assert 0 < len(result["local_numel"]) < len(whole), family
    split = []
    for name, value in whole.items():
        held = holders(result, name)  # every rank's, not rank 0's: a rank holding more is a memory bug too
        if pipelined and not held:
            continue  # not of the first stage
        assert held, (family, name, "held by no rank")
        if name in experts:
            assert held == [value.numel() // ranks] * len(held), (family, name, held)
        elif dense_sharded and held != [value.numel()] * len(held):
            # Split by tensor parallelism and/or FSDP2 into k parts (k = 2 or 4; FSDP2's rows may split unevenly):
            # the copies of the whole the ranks hold together are a whole number of whole tensors.
            parts = value.numel() * len(held) / sum(held)
            assert parts in (2, 4) and max(held) < value.numel(), (family, name, held, parts)
            split.append(name)
        else:
            assert held == [value.numel()] * len(held), (family, name, held)
    if dense_sharded:  # split dense parameters, not only "at most whole" (which holds for any layout)
        assert split, f"{family}: no dense parameter split, though the layout splits them"


def holders(result: dict, name: str) -> list[int]:
    """The local sizes of parameter ``name`` on every rank holding part of it, by global rank."""
    return [local[name] for local in result["local_numel_by_rank"] if name in local]


def assert_checkpoint_loads_into_the_plain_model(family: str, path, result: dict, clip: float | None = None) -> None:
    """A checkpoint written under TP holds the module's own layout (fused rows in q|k|v order, Conv1D
    as stored): it loads into the unsplit transformers model and equals the trained weights, and the
    optimizer's momentum is the single-device one (sum of 0.9^k-weighted gradients, in module order)."""
    from lightning_parallel import ParallelCheckpointIO

    checkpoint = ParallelCheckpointIO().load_checkpoint(path)
    if family in LIST_MOE:  # nn.ModuleList experts: saved by their global index, every rank's
        from tests.hf_models import ListMoELM

        plain = ListMoELM(old_mixtral=family == "old_mixtral").double()
    else:
        plain = make_hf_model(family).double()
    plain.load_state_dict(checkpoint["state_dict"])  # strict: same names and whole shapes
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, result["states"][-1][name].double(), rtol=0, atol=TOL, msg=name)
    momentum = checkpoint["optimizer_states"][0]["state"]
    if family in LIST_MOE:  # every rank's experts, by global name
        assert set(momentum) == {name for name, _ in plain.named_parameters()}, family
    # Gradients clipped by norm (``clip``) enter the momentum scaled as torch scales them.
    scales = [
        min(1.0, clip / (float(torch.sqrt(sum(g.double().square().sum() for g in grads.values()))) + 1e-6)) if clip else 1.0
        for grads in result["grads"]
    ]
    if clip:
        assert min(scales) < 1, "the clipping test never clipped"
    for name, buffer in momentum.items():
        expected = sum(0.9 ** (len(result["grads"]) - 1 - k) * scales[k] * grads[name] for k, grads in enumerate(result["grads"]))
        torch.testing.assert_close(buffer["momentum_buffer"].double(), expected.double(), rtol=0, atol=TOL, msg=name)
    if family not in LIST_MOE:  # not a transformers model
        assert_exports_for_serving(family, path, plain)


def assert_exports_for_serving(family: str, path, plain) -> None:
    """The checkpoint of a multi-rank run exports to a Hugging Face directory (sharded over several files) that
    ``from_pretrained`` loads with exactly the trained weights, tied head included."""
    from transformers import AutoModelForCausalLM

    from lightning_parallel.checkpoint.export import export

    directory = Path(path).parent / "hf-export"
    export(path, directory, config=plain.net.config, max_shard_size="16KB")
    assert (directory / "model.safetensors.index.json").exists(), sorted(p.name for p in directory.iterdir())
    served = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float64)
    expected = plain.net.state_dict()
    for name, value in served.state_dict().items():
        assert torch.equal(value, expected[name]), (family, name)
