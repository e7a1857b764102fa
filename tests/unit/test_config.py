"""Every config file composes and instantiates (lightning-hydra-template style): the recipe's (conf/) and the
library's (lightning_parallel/conf/: strategy/, hardware/, the planner's config), which any Hydra app finds by name."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import lightning_parallel
from lightning_parallel.conf import CONFIG_DIR as LIBRARY_CONF

CONF = Path(__file__).resolve().parents[2] / "conf"
OPTIONS = sorted({
    (group.name, file.stem)
    for root in (CONF, LIBRARY_CONF) for group in root.iterdir() if group.is_dir() for file in group.glob("*.yaml")
})


# Models read their sizes from the data config, so these options come in pairs.
COMPANIONS = {("data", "images"): ["model=convnet"], ("model", "convnet"): ["data=images"]}


def compose_config(overrides: list[str], output_dir: Path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*overrides, f"paths.output_dir={output_dir}"])


def test_every_group_has_options():
    groups = {group for group, _ in OPTIONS}
    assert {"strategy", "trainer", "model", "data", "experiment", "hardware"} <= groups


def test_each_file_lives_once():
    """The recipe's conf/ reaches the library's groups through the search path: it copies none of their files (a
    symbolic link is the same file)."""
    library = {path.relative_to(LIBRARY_CONF) for path in LIBRARY_CONF.rglob("*.yaml")}
    copies = [str(path) for path in CONF.rglob("*.yaml") if path.relative_to(CONF) in library and not path.is_symlink()]
    assert not copies, f"copies of lightning_parallel/conf files in conf/: {copies}"
    assert {"strategy/data.yaml", "hardware/h100_ib.yaml", "strategy/plan/llama.yaml", "plan.yaml"} <= {str(p) for p in library}


def test_any_app_finds_the_library_groups_by_name(tmp_path):
    """A user's own Hydra app (a config directory of its own, nothing of ours copied) names our groups: the package's
    Hydra plugin puts lightning_parallel/conf on every app's search path, after the app's own directory."""
    (tmp_path / "config.yaml").write_text("defaults:\n  - strategy: tensor\n  - hardware: h100_ib\n  - _self_\n"
                                          "trainer: {accelerator: cpu}\n")
    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "mine.yaml").write_text("_target_: lightning_parallel.DataParallelStrategy\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        cfg = compose("config", overrides=["strategy.tensor_parallel_size=2", "+strategy/plan=llama"])
        single = compose("config", overrides=["strategy=single"])
        mine = compose("config", overrides=["strategy=mine"])  # the app's own option beside ours, in the same group
    assert isinstance(instantiate(cfg.strategy), lightning_parallel.TensorParallelStrategy)
    assert cfg.strategy.plan["model.model.layers.*.mlp.down_proj"] == "rowwise" and cfg.hardware.name == "h100_ib"
    assert single.strategy.device == "cpu" and mine.strategy._target_ == "lightning_parallel.DataParallelStrategy"


def test_planner_outside_a_project_plans_from_its_own_config(tmp_path, monkeypatch, capsys):
    """No conf/config.yaml in the working directory: the library's planner config, which asks for the model."""
    from lightning_parallel.plan.__main__ import main

    monkeypatch.chdir(tmp_path)
    assert main(["trainer.devices=4", "hardware=h100_ib"]) == 2
    output = capsys.readouterr().out
    assert "data._target_, data.batch_size, model._target_ not set" in output and "plan.yaml" in output


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_config_composes_and_instantiates(group, option, tmp_path):
    cfg = compose_config([f"{group}={option}", *COMPANIONS.get((group, option), [])], tmp_path)
    with torch.device("meta"):  # the large experiments' models need no memory to be checked
        model = instantiate(cfg.model)
    data = instantiate(cfg.data)
    assert isinstance(model, L.LightningModule) and isinstance(data, L.LightningDataModule)
    strategy = instantiate(cfg.strategy)
    if cfg.trainer.accelerator == "cuda" and not torch.cuda.is_available():
        # No Trainer without CUDA, but the layout must fill the cluster the config asks for exactly.
        world = cfg.trainer.devices * cfg.trainer.num_nodes
        if isinstance(strategy, lightning_parallel.ParallelEngineStrategy):
            assert strategy._requested_layout.resolve(world).world_size == world
        pytest.skip("the GPU trainer config needs CUDA to build a Trainer")
    trainer = instantiate(cfg.trainer, strategy=strategy)
    assert trainer.strategy is strategy
    assert any(isinstance(cb, lightning_parallel.TrainingSummary) for cb in trainer.callbacks)


STRATEGY_FILES = sorted((LIBRARY_CONF / "strategy").glob("*.yaml"))


@pytest.mark.parametrize("path", STRATEGY_FILES, ids=[p.stem for p in STRATEGY_FILES])
def test_strategy_files_repeat_no_default_differently(path):
    """The YAML lists each option (so that `strategy.<option>=` overrides work) with the preset's own default:
    defaults live in the component dataclasses, and a file may not drift from them."""
    import inspect

    from hydra.utils import get_class
    from omegaconf import OmegaConf

    options = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    strategy = get_class(options.pop("_target_"))
    options.pop("_convert_", None)  # Hydra's own key
    if not issubclass(strategy, lightning_parallel.ParallelEngineStrategy):
        pytest.skip(f"{strategy.__name__} is Lightning's own")
    parameters = inspect.signature(strategy).parameters
    for name, value in options.items():
        assert name in parameters, f"{path.name}: {name} is not an option of {strategy.__name__}"
        default = parameters[name].default
        if isinstance(value, str) and value.startswith("${"):
            continue  # taken from another config group (strategy=auto's hardware), not a default
        if isinstance(default, tuple):
            value = tuple(value)
        assert value == default, f"{path.name}: {name}={value!r}, but {strategy.__name__} defaults to {default!r}"


def test_command_line_style_overrides_reach_the_strategy(tmp_path):
    cfg = compose_config(
        ["strategy=data", "trainer.devices=2", "trainer.accumulate_grad_batches=4", "strategy.comm_hook=fp16"], tmp_path
    )
    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy))
    assert isinstance(trainer.strategy, lightning_parallel.DataParallelStrategy)
    assert trainer.accumulate_grad_batches == 4
    assert trainer.strategy.layout.data_parallel_size == 2
    assert trainer.strategy.data_parallel.config.comm_hook == "fp16"


def test_model_follows_the_data(tmp_path):
    cfg = compose_config(["data.block_size=32"], tmp_path)
    assert cfg.model.block_size == 32 and cfg.model.vocab_size == cfg.data.vocab_size
    cfg = compose_config(["experiment=convnet_syncbn"], tmp_path)
    assert cfg.model.num_classes == cfg.data.num_classes and cfg.strategy.sync_batchnorm is True


class _HFStyleDecoder(torch.nn.Module):
    """Module names as in Hugging Face Llama: model.layers.N.self_attn.*_proj, model.layers.N.mlp.*_proj."""

    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(layer.self_attn, name, torch.nn.Linear(16, 16, bias=False))
        layer.mlp = torch.nn.Module()
        layer.mlp.gate_proj, layer.mlp.up_proj = torch.nn.Linear(16, 48), torch.nn.Linear(16, 48)
        layer.mlp.down_proj = torch.nn.Linear(48, 16)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])


@pytest.mark.parametrize("preset", ["gpt", "llama"])
def test_plan_presets_equal_the_inferred_plan(preset, tmp_path):
    from lightning_parallel.parallelize.tensor.apply import infer_plan, resolve_plan

    cfg = compose_config(["strategy=tensor", f"+strategy/plan={preset}"], tmp_path)
    strategy = instantiate(cfg.strategy)
    wrapper = torch.nn.Module()
    wrapper.model = instantiate(cfg.model).model if preset == "gpt" else _HFStyleDecoder()
    assert resolve_plan(wrapper, dict(cfg.strategy.plan)).styles == infer_plan(wrapper)
    assert strategy.tensor_parallel.config.plan == dict(cfg.strategy.plan)
