"""``python -m lightning_parallel.checkpoint export CKPT DIR --format hf``: a Hugging Face directory from a checkpoint.

Checkpoints come from a short single-device float64 run with this library's ``ParallelCheckpointIO`` (the
``full`` format) and its conversion to the ``sharded`` format (DCP, written from this one process, as the
``convert`` command does); both hold every tensor by the module's own names whatever layout wrote them.
``from_pretrained`` must load exactly the trained weights, with no missing or unexpected names.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.checkpoint.__main__ import convert, main
from lightning_parallel.checkpoint.export import SAFE_WEIGHTS_INDEX_NAME, export, export_hf, parse_size
from lightning_parallel.checkpoint.io import ParallelCheckpointIO
from tests.hf_models import VOCAB, HFCausalLM, build_config

transformers = pytest.importorskip("transformers")


class ExportLM(HFCausalLM):
    """A transformers LM held as ``self.net``; optionally its config among the hyperparameters, and a buffer
    outside the model (which the export leaves out)."""

    def __init__(self, family: str = "llama", tie: bool = True, config_in_hparams: bool = False) -> None:
        super().__init__(family)
        config = build_config(family)
        config.tie_word_embeddings = tie
        self.net = transformers.AutoModelForCausalLM.from_config(config)
        if config_in_hparams:
            self.save_hyperparameters({"config": self.net.config.to_dict(), "lr": 0.1})
        self.register_buffer("loss_scale", torch.ones(1))


def _train(model: L.LightningModule, path: Path) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (8, 9))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="64-true", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, plugins=[ParallelCheckpointIO()],
    )
    trainer.fit(model, loader)
    trainer.save_checkpoint(path)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def trained(request, tmp_path_factory):
    """(family, trained LightningModule, {format: checkpoint path}, config.json directory)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"export_{family}")
    torch.manual_seed(1)
    # llama tied (tie_word_embeddings=True) with its config passed by hand; gpt2 (tied, fused Conv1D c_attn)
    # with the config saved among the hyperparameters.
    model = ExportLM(family, tie=True, config_in_hparams=family == "gpt2")
    initial = {k: v.clone() for k, v in model.net.state_dict().items()}
    _train(model, root / "full.ckpt")
    assert not torch.equal(initial["lm_head.weight"], model.net.state_dict()["lm_head.weight"].float())  # trained
    convert(root / "full.ckpt", root / "sharded.ckpt")
    model.net.config.save_pretrained(root / "config")
    return family, model, {"full": root / "full.ckpt", "sharded": root / "sharded.ckpt"}, root / "config"


def _config_for(family: str, config_dir: Path) -> Path | None:
    return None if family == "gpt2" else config_dir / "config.json"


def _assert_loads_exactly(directory: Path, model: L.LightningModule) -> None:
    from transformers.utils import logging

    logging.set_verbosity_warning()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    trained = model.net.state_dict()
    state = loaded.state_dict()
    assert state.keys() == trained.keys()
    for name, value in trained.items():
        assert state[name].dtype == torch.float64, name
        assert torch.equal(state[name], value), name
    assert loaded.config.tie_word_embeddings is True
    assert loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()  # still tied
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, model.net(input_ids=tokens).logits)


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_export_loads_with_from_pretrained(trained, fmt, tmp_path):
    family, model, checkpoints, config_dir = trained
    out = tmp_path / "hf"
    summary = export(checkpoints[fmt], out, config=_config_for(family, config_dir))
    assert summary.prefix == "net."
    assert summary.tied_left_out == ["lm_head.weight"]
    assert summary.outside_prefix == 1  # loss_scale
    assert (out / "model.safetensors").is_file() and not (out / SAFE_WEIGHTS_INDEX_NAME).exists()
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(model.net).__name__]
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        stored = {name: handle.get_tensor(name) for name in handle.keys()}
    assert "lm_head.weight" not in stored
    assert list(stored) == sorted(stored)  # safetensors lists names sorted; order checked in the index test
    if family == "gpt2":  # fused Conv1D c_attn stored as the module holds it: [in, out], q | k | v columns
        fused = stored["transformer.h.0.attn.c_attn.weight"]
        assert fused.shape == (32, 96) and torch.equal(fused, model.net.transformer.h[0].attn.c_attn.weight)
    _assert_loads_exactly(out, model)


def test_sharded_index_past_max_shard_size(trained, tmp_path):
    family, model, checkpoints, config_dir = trained
    out = tmp_path / "hf"
    summary = export_hf(checkpoints["sharded"], out, config=_config_for(family, config_dir), max_shard_size="20KB", prefix="net.")
    weights = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(weights) >= 2 and weights == [f"model-{i:05d}-of-{len(weights):05d}.safetensors" for i in range(1, len(weights) + 1)]
    index = json.loads((out / SAFE_WEIGHTS_INDEX_NAME).read_text())
    expected = {k: v for k, v in model.net.state_dict().items() if k != "lm_head.weight"}
    assert set(index["weight_map"]) == set(expected) and set(index["weight_map"].values()) == set(weights)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in expected.values()) == summary.bytes
    # Files in the module's order: the index's files are consecutive runs of the module's names.
    order = [index["weight_map"][k] for k in expected]
    assert order == sorted(order)
    _assert_loads_exactly(out, model)


def test_dtype_conversion(trained, tmp_path):
    family, model, checkpoints, config_dir = trained
    out = tmp_path / "hf"
    export(checkpoints["full"], out, config=_config_for(family, config_dir), dtype="bfloat16")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    for name, value in model.net.state_dict().items():
        assert loaded.state_dict()[name].dtype == torch.bfloat16
        assert torch.equal(loaded.state_dict()[name], value.to(torch.bfloat16)), name


def test_cli_and_bad_input(trained, tmp_path, capsys):
    family, model, checkpoints, config_dir = trained
    config = _config_for(family, config_dir)
    config_args = ["--config", str(config)] if config else []
    out = tmp_path / "hf"
    assert main(["export", str(checkpoints["full"]), str(out), "--format", "hf", "--prefix", "net.", *config_args]) == 0
    assert "tied, left out" in capsys.readouterr().out
    # Exists and non-empty: refused, nothing touched; --overwrite replaces only the export's own files.
    (out / "README.md").write_text("mine")
    (out / "model-00001-of-00009.safetensors").write_text("stale")
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(["export", str(checkpoints["full"]), str(out), *config_args]) == 1
    assert "exists" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert main(["export", str(checkpoints["sharded"]), str(out), "--overwrite", *config_args]) == 0
    assert (out / "README.md").read_text() == "mine" and not (out / "model-00001-of-00009.safetensors").exists()
    _assert_loads_exactly(out, model)

    with pytest.raises(FileNotFoundError, match="no-such.ckpt"):
        export(tmp_path / "no-such.ckpt", tmp_path / "a", config=config)
    with pytest.raises(ValueError, match="format='onnx' is unknown; choose one of hf"):
        export(checkpoints["full"], tmp_path / "b", format="onnx", config=config)
    assert main(["export", str(checkpoints["full"]), str(tmp_path / "b"), "--format", "onnx"]) == 1
    with pytest.raises(ValueError, match=r"prefix='model\.' matches none of .*'net\."):
        export(checkpoints["full"], tmp_path / "c", config=config, prefix="model.")
    with pytest.raises(ValueError, match="max_shard_size"):
        export(checkpoints["full"], tmp_path / "d", config=config, max_shard_size="lots")
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_config_required_or_matching(trained, tmp_path):
    family, model, checkpoints, config_dir = trained
    if family == "llama":  # no config among its hyperparameters
        with pytest.raises(ValueError, match="holds no Hugging Face config.*--config"):
            export(checkpoints["full"], tmp_path / "a")
    # A config of another shape: every difference named, nothing written.
    other = build_config(family)
    other.tie_word_embeddings = True
    other.vocab_size = VOCAB * 2
    with pytest.raises(ValueError, match="does not fit.*shape mismatch"):
        export(checkpoints["sharded"], tmp_path / "b", config=other)
    assert not (tmp_path / "b").exists()
    # Two copies of the model (say, an EMA beside it): which one is ambiguous, so --prefix is asked for.
    state = model.net.state_dict()
    torch.save({"state_dict": {**{f"net.{k}": v for k, v in state.items()}, **{f"ema.{k}": v for k, v in state.items()}}}, tmp_path / "two.ckpt")
    with pytest.raises(ValueError, match=r"several prefixes .*\['ema\.', 'net\.'\].*--prefix"):
        export(tmp_path / "two.ckpt", tmp_path / "c", config=model.net.config)
    export(tmp_path / "two.ckpt", tmp_path / "c", config=model.net.config, prefix="ema.")
    _assert_loads_exactly(tmp_path / "c", model)


def test_untied_checkpoint_with_tying_config_is_refused(tmp_path):
    torch.manual_seed(1)
    model = ExportLM("llama", tie=False)
    _train(model, tmp_path / "untied.ckpt")
    tying = build_config("llama")
    tying.tie_word_embeddings = True
    with pytest.raises(ValueError, match="trained untied"):
        export(tmp_path / "untied.ckpt", tmp_path / "hf", config=tying)
    # With its own (untied) config it exports both weights.
    summary = export(tmp_path / "untied.ckpt", tmp_path / "hf2", config=model.net.config)
    assert summary.tied_left_out == []
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.net.state_dict().items())


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError):
        parse_size("0")
