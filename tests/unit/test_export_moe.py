"""Mixture-of-Experts models export in the Hub's layout: one module per expert, as ``save_pretrained`` writes.

transformers 5 trains Mixtral, Qwen3-MoE and DeepSeek-V3 with fused 3-D experts and converts the Hub's per-expert
tensors on load; the export converts back with transformers' own reverse conversion. Checkpoints come from a short
single-device float64 run (``full`` format, and its ``sharded`` conversion); the 2-rank dp2 ep2 runs of
``tests/distributed/test_transformers.py`` export theirs the same way (experts divided over the ranks while training).
Over every family transformers converts, ``python -m tests.export_sweep`` records which export exactly
(``tests/export_sweep.json``, checked here against the docs).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.checkpoint.__main__ import convert, main
from lightning_parallel.checkpoint.export import SAFE_WEIGHTS_INDEX_NAME, export
from lightning_parallel.checkpoint.io import ParallelCheckpointIO
from tests.export_sweep import RESULTS, compare_loaded
from tests.hf_models import VOCAB, HFOtherLM

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
#: family -> (a Hub name the export must write, the fused name it comes from)
FAMILIES = {
    "mixtral": ("model.layers.0.block_sparse_moe.experts.3.w1.weight", "model.layers.0.mlp.experts.gate_up_proj"),
    "qwen3_moe": ("model.layers.1.mlp.experts.2.up_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"),
    "deepseek_v3": ("model.layers.1.mlp.experts.0.down_proj.weight", "model.layers.1.mlp.experts.down_proj"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def trained(request, tmp_path_factory):
    """(family, the trained LightningModule, {format: checkpoint}, the save_pretrained directory of its net)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"export_{family}")
    torch.manual_seed(1)
    model = HFOtherLM(family)
    initial = {k: v.clone() for k, v in model.net.state_dict().items()}
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (8, 9))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="64-true", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, plugins=[ParallelCheckpointIO()],
    )
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4))
    trainer.save_checkpoint(root / "full.ckpt")
    fused = FAMILIES[family][1]
    assert not torch.equal(initial[fused], model.net.state_dict()[fused].to(initial[fused].dtype))  # experts trained
    convert(root / "full.ckpt", root / "sharded.ckpt")
    model.net.save_pretrained(root / "save_pretrained")
    return family, model, {"full": root / "full.ckpt", "sharded": root / "sharded.ckpt"}, root / "save_pretrained"


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: value for file in sorted(directory.glob("*.safetensors")) for name, value in load_file(file).items()}


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_export_writes_the_hub_layout(trained, fmt, tmp_path):
    family, model, checkpoints, reference = trained
    hub_name, fused_name = FAMILIES[family]
    summary = export(checkpoints[fmt], tmp_path / "hf", config=model.net.config)
    stored, expected = _stored(tmp_path / "hf"), _stored(reference)
    # The names and values save_pretrained writes: each expert a module of its own, nothing fused.
    assert stored.keys() == expected.keys() and hub_name in stored and fused_name not in stored
    assert all(torch.equal(stored[name], expected[name]) for name in expected)
    assert summary.converted == len(model.net.state_dict().keys() - expected.keys()) > 0  # experts split, routers renamed
    _assert_same_model(tmp_path / "hf", model)


def _assert_same_model(directory: Path, model: L.LightningModule) -> None:
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float64, experts_implementation="eager", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    net = type(model.net)(model.net.config).double().eval()  # a copy of the trained net: rounded where loaded is
    net.load_state_dict(model.net.state_dict())
    wrong, kept = compare_loaded(net, loaded)  # every tensor bitwise (float32-kept routers rounded as loaded)
    assert not wrong, wrong
    assert all(".mlp.gate." in name for name in kept), kept  # DeepSeek-V3's router only
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=tokens).logits, net(input_ids=tokens).logits)


def test_shards_keep_each_layer_s_experts_together_and_cli(trained, tmp_path, capsys):
    family, model, checkpoints, _ = trained
    (tmp_path / "config").mkdir()
    model.net.config.save_pretrained(tmp_path / "config")
    out = tmp_path / "hf"
    args = ["export", str(checkpoints["sharded"]), str(out), "--config", str(tmp_path / "config"), "--max-shard-size", "8KB"]
    assert main(args) == 0
    assert "converted to the Hub's layout" in capsys.readouterr().out
    index = json.loads((out / SAFE_WEIGHTS_INDEX_NAME).read_text())["weight_map"]
    assert len(set(index.values())) >= 3 and set(index) == set(_stored(out))
    # One fused tensor's experts are written from one read: all in one file.
    hub_name = FAMILIES[family][0]
    siblings = {f for n, f in index.items() if n.rsplit(".experts.", 1)[0] == hub_name.rsplit(".experts.", 1)[0]
                and n.endswith(hub_name.rsplit(".", 2)[-2] + ".weight")}
    assert len(siblings) == 1, siblings
    _assert_same_model(out, model)
    # --no-original-format: the model's own fused tensors, which transformers 5 loads as well.
    assert main([*args[:2], str(tmp_path / "fused"), *args[3:], "--no-original-format"]) == 0
    fused = _stored(tmp_path / "fused")
    assert FAMILIES[family][1] in fused and hub_name not in fused
    _assert_same_model(tmp_path / "fused", model)


def test_sweep_results_and_docs_agree():
    """The committed sweep: the three families of issue 53 export exactly, every converted family has a result,
    and docs/checkpoints.md names exactly the families that export exactly."""
    results = json.loads(RESULTS.read_text())
    assert set(results["results"]) == set(results["converted_families"])
    exact = sorted(t for t, cell in results["results"].items() if cell["result"] == "exact")
    assert {"mixtral", "qwen3_moe", "deepseek_v3", "qwen2_moe", "olmoe"} <= set(exact)
    assert all(cell["result"] == "exact" or cell.get("error") or cell.get("names") for cell in results["results"].values())
    docs = (REPO / "docs" / "checkpoints.md").read_text()
    line = next(line for line in docs.splitlines() if line.startswith("Exact (the sweep):"))
    assert sorted(name.strip(" `.") for name in line.split(":", 1)[1].split(",")) == exact


def test_plan_square_transposes_and_joined_reverses():
    """hub_layout.plan on conversions transformers ships for other families, attached to a tiny Llama: a transpose of
    a square tensor (same name and shape: not the identity) converts on its own; a Hub tensor split into q, k, v on
    load (its reverse joins three) converts as one group. Either way the result is save_pretrained's."""
    from transformers.core_model_loading import Chunk, Transpose, WeightConverter

    from lightning_parallel.checkpoint import hub_layout

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
    model._weight_conversions = [WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight", operations=[Transpose(0, 1)])]
    groups = hub_layout.plan(model, shapes)
    (square,) = [g for g in groups if g.renamed]
    assert square.inputs == ("model.layers.0.mlp.down_proj.weight",) and len(groups) == len(state)
    written = hub_layout.converted(model, square, state)
    assert torch.equal(written["model.layers.0.mlp.down_proj.weight"], state["model.layers.0.mlp.down_proj.weight"].T)
    model._weight_conversions = [WeightConverter(
        "self_attn.qkv_proj.weight", ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        operations=[Chunk(dim=0)])]
    groups = hub_layout.plan(model, shapes)
    (joined,) = [g for g in groups if g.renamed]
    assert set(joined.inputs) == {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"}
    assert list(joined.outputs) == ["model.layers.0.self_attn.qkv_proj.weight"]
    expected = hub_layout.to_hub_layout(model, state)
    assert torch.equal(hub_layout.converted(model, joined, state)["model.layers.0.self_attn.qkv_proj.weight"],
                       expected["model.layers.0.self_attn.qkv_proj.weight"])
