"""Loading what users download is safe: a checkpoint whose pickle would run code is refused, with the file, the
type and the opt-in named, before any of it runs; the checkpoints the library writes load without the opt-in."""

from __future__ import annotations

import dataclasses
import pickle
import typing
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch import nn
from torch.serialization import get_unsafe_globals_in_checkpoint

from lightning_parallel.checkpoint.__main__ import convert
from lightning_parallel.checkpoint.__main__ import main as checkpoint_cli
from lightning_parallel.checkpoint.files import INFO_KEY, atomic_torch_save
from lightning_parallel.checkpoint.io import ParallelCheckpointIO
from lightning_parallel.checkpoint.pretrained import load_pretrained
from lightning_parallel.checkpoint.sharded import read_whole, write_whole
from lightning_parallel.checkpoint.unpickling import (
    UntrustedPickleError,
    checkpoint_types,
)
from lightning_parallel.strategies.checkpoint_files import (
    CheckpointFiles,
    replica_file_name,
)
from lightning_parallel.strategies.components.placement import local_targets

#: What torch's refusal names: the function the malicious pickle would call.
OFFENDER = f"{__name__}._leave_mark"


def _leave_mark(path: str) -> str:
    """Stands in for os.system: proves that unpickling ran code named by the file."""
    Path(path).write_text("ran")
    return "ran"


class RunsCode:
    """Pickles as a call of ``_leave_mark(marker)``, as a malicious checkpoint would pickle ``os.system(...)``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_leave_mark, (self.marker,))


def lightning_like(model: nn.Module, **extra) -> dict:
    names = [name for name, _ in model.named_parameters()]
    return {
        "epoch": 0,
        "global_step": 3,
        "state_dict": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": names}]}],
        INFO_KEY: {"format": "full", "layout": {"pp": 1, "dp": 1, "tp": 1}, "world_size": 1},
        **extra,
    }


def shapes_of(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def assert_refused(raised: pytest.ExceptionInfo, path: Path, opt_in: str, marker: Path) -> str:
    message = str(raised.value)
    assert str(path) in message and OFFENDER in message and opt_in in message and "add_safe_globals" in message, message
    assert "runs whatever code the file names" in message and "Nothing from the file was run" in message
    assert not marker.exists(), "the file's code ran"
    return message


# ---------------------------------------------------------------------------- files that would run code


def test_weights_from_a_file_that_would_run_code_is_refused_and_loads_only_when_trusted(tmp_path):
    marker = tmp_path / "MARKER"
    source = nn.Linear(3, 2)
    torch.save(lightning_like(source, hyper_parameters={"callback": RunsCode(marker)}), tmp_path / "model.ckpt")
    target = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(UntrustedPickleError) as raised:
        load_pretrained(tmp_path / "model.ckpt", local_targets(target), None, whole_shapes=shapes_of(target))
    assert isinstance(raised.value, ValueError)
    assert_refused(raised, tmp_path / "model.ckpt", "trust_pickle=True", marker)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())

    load_pretrained(tmp_path / "model.ckpt", local_targets(target), None, whole_shapes=shapes_of(target), trust_pickle=True)
    assert marker.exists()  # the opt-in unpickles in full: the file's code ran
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in target.state_dict().items())


@dataclasses.dataclass
class UserConfig:
    """A type of the user's own among the hyperparameters (no code runs to build it, but torch cannot know that)."""

    width: int = 8


def test_a_type_of_the_users_own_is_allowed_by_name_without_trusting_the_whole_file(tmp_path):
    module = nn.Linear(3, 2)
    torch.save(lightning_like(module, hyper_parameters={"config": UserConfig()}), tmp_path / "model.ckpt")
    with pytest.raises(UntrustedPickleError, match=f"holds `{__name__}.UserConfig`"):
        load_pretrained(tmp_path / "model.ckpt", local_targets(nn.Linear(3, 2)), None, whole_shapes=shapes_of(module))
    with torch.serialization.safe_globals([UserConfig]):
        loaded = ParallelCheckpointIO().load_checkpoint(tmp_path / "model.ckpt")
        load_pretrained(tmp_path / "model.ckpt", local_targets(nn.Linear(3, 2)), None, whole_shapes=shapes_of(module))
    assert loaded["hyper_parameters"]["config"] == UserConfig()


def test_the_strategy_carries_trust_pickle_beside_weights_from():
    from lightning_parallel import DataParallelStrategy

    assert DataParallelStrategy(weights_from="w.ckpt").placement.trust_pickle is False
    assert DataParallelStrategy(weights_from="w.ckpt", trust_pickle=True).placement.trust_pickle is True
    with pytest.raises(TypeError, match="trust_pickle must be True or False, got 'yes'"):
        DataParallelStrategy(trust_pickle="yes")
    # The Hydra group lists it (strategy.trust_pickle=true on a recipe's command line).
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from lightning_parallel.conf import CONFIG_DIR

    config = OmegaConf.load(Path(CONFIG_DIR) / "strategy" / "data.yaml")
    assert config.trust_pickle is False
    config.trust_pickle = True
    assert instantiate(config).placement.trust_pickle is True


def test_the_cli_refuses_a_checkpoint_that_would_run_code_unless_trusted(tmp_path, capsys):
    marker = tmp_path / "MARKER"
    atomic_torch_save(lightning_like(nn.Linear(3, 2), hyper_parameters={"x": RunsCode(marker)}), tmp_path / "a.ckpt")
    for command in (["inspect", str(tmp_path / "a.ckpt")], ["convert", str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")],
                    ["export", str(tmp_path / "a.ckpt"), str(tmp_path / "hf")]):
        assert checkpoint_cli(command) == 1, command
        error = capsys.readouterr().err
        assert str(tmp_path / "a.ckpt") in error and OFFENDER in error and "--trust-pickle" in error, error
    assert not marker.exists() and not (tmp_path / "b.ckpt").exists() and not (tmp_path / "hf").exists()
    assert checkpoint_cli(["inspect", str(tmp_path / "a.ckpt"), "--trust-pickle"]) == 0
    assert "global step 3" in capsys.readouterr().out and marker.exists()


def test_a_sharded_checkpoint_that_would_run_code_is_refused_in_each_of_its_pickles(tmp_path):
    """meta.pt (Lightning's state), a non-tensor item of the DCP files (param_groups) and DCP's own .metadata."""
    marker = tmp_path / "MARKER"
    module = nn.Linear(3, 2)
    write_whole(lightning_like(module, hyper_parameters={"x": RunsCode(marker)}), tmp_path / "meta")
    with pytest.raises(UntrustedPickleError) as raised:
        read_whole(tmp_path / "meta")
    assert_refused(raised, tmp_path / "meta" / "meta.pt", "trust_pickle=True", marker)

    in_items = lightning_like(module)
    in_items["optimizer_states"][0]["param_groups"][0]["lr"] = RunsCode(marker)
    write_whole(in_items, tmp_path / "items")
    with pytest.raises(UntrustedPickleError) as raised:
        ParallelCheckpointIO().load_checkpoint(tmp_path / "items")
    assert "(item optimizer_0.param_groups.0.lr)" in assert_refused(raised, tmp_path / "items", "weights_only=False", marker)
    assert checkpoint_cli(["convert", str(tmp_path / "items"), str(tmp_path / "items.full")]) == 1
    assert not marker.exists()
    read_whole(tmp_path / "items", weights_only=False)  # trusted: DCP's own full unpickle
    assert marker.exists()
    marker.unlink()

    write_whole(lightning_like(module), tmp_path / "index")
    (tmp_path / "index" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    for read in (lambda: read_whole(tmp_path / "index"),
                 lambda: load_pretrained(tmp_path / "index", local_targets(module), None, whole_shapes=shapes_of(module))):
        with pytest.raises(UntrustedPickleError) as raised:
            read()
        # No option trusts DCP's index: torch writes only its own types there.
        assert "please report" in assert_refused(raised, tmp_path / "index", "in its DCP index (.metadata)", marker)


def test_resuming_refuses_a_checkpoint_that_would_run_code_unless_weights_only_is_false(tmp_path):
    marker = tmp_path / "MARKER"
    atomic_torch_save(lightning_like(nn.Linear(3, 2), hyper_parameters={"x": RunsCode(marker)}), tmp_path / "a.ckpt")
    for weights_only in (None, True):
        with pytest.raises(UntrustedPickleError) as raised:
            ParallelCheckpointIO().load_checkpoint(tmp_path / "a.ckpt", weights_only=weights_only)
        assert_refused(raised, tmp_path / "a.ckpt", "weights_only=False to trainer.fit", marker)
    assert ParallelCheckpointIO().load_checkpoint(tmp_path / "a.ckpt", weights_only=False)["hyper_parameters"]["x"] == "ran"


class _Periodic:
    """DiLoCo's state as PeriodicSync keeps it: outer parameters and an outer Nesterov SGD."""

    def __init__(self, module: nn.Module) -> None:
        self.outer = [p.detach().clone().requires_grad_() for p in module.parameters()]
        self.optimizer = torch.optim.SGD(self.outer, lr=0.7, momentum=0.9, nesterov=True)
        sum(p.sum() for p in self.outer).backward()
        self.optimizer.step()
        self.loaded = None

    def state_dict(self) -> dict:
        return {"outer_parameters": [p.clone() for p in self.outer], "outer_optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def _replica_files(tmp_path: Path) -> tuple[CheckpointFiles, nn.Module, _Periodic]:
    """The engine's CheckpointFiles around a stand-in engine: one replica of a periodic-sync run, rank 0."""
    module = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    periodic = _Periodic(module)
    engine = SimpleNamespace(
        lightning_module=module, optimizers=[optimizer], global_rank=0, root_device=torch.device("cpu"),
        layout=SimpleNamespace(data_parallel_size=2),
        data_parallel=SimpleNamespace(periodic_sync=periodic, sync=SimpleNamespace(method="diloco")),
    )
    files = CheckpointFiles(engine, "sharded", False, timedelta(seconds=30))
    files.sharded_source = tmp_path
    return files, module, periodic


def test_replica_files_of_a_resume_load_without_the_opt_in_and_refuse_code(tmp_path):
    files, module, periodic = _replica_files(tmp_path)
    saved = files._replica_state(periodic)
    atomic_torch_save(saved, tmp_path / replica_file_name(0))  # as CheckpointFiles.save writes it
    with torch.no_grad():
        module.weight.zero_()
    files.restore_replica_state()
    assert torch.equal(module.weight, saved["model"]["weight"]) and periodic.loaded["outer_optimizer"]["param_groups"][0]["nesterov"]

    marker = tmp_path / "MARKER"
    atomic_torch_save({**saved, "sync": RunsCode(marker)}, tmp_path / replica_file_name(0))
    with pytest.raises(UntrustedPickleError) as raised:
        files.restore_replica_state()
    assert_refused(raised, tmp_path / replica_file_name(0), "weights_only=False to trainer.fit", marker)
    files.trust_pickle = True  # what load(weights_only=False) sets
    files.restore_replica_state()
    assert marker.exists() and periodic.loaded == "ran"


# ---------------------------------------------------------------------------- our own checkpoints, no opt-in


@pytest.fixture(scope="module")
def recipe_checkpoint(tmp_path_factory) -> tuple[Path, L.LightningModule]:
    """A full checkpoint as recipes/train.py writes one: a recipe model and data module instantiated by Hydra from
    their config (so the hyperparameters are OmegaConf containers), trained two steps, saved by ParallelCheckpointIO."""
    pytest.importorskip("transformers")
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    root = tmp_path_factory.mktemp("recipe_checkpoint")
    model = instantiate(OmegaConf.create({
        "_target_": "recipes.models.transformers_lm.TransformersCausalLM", "model_type": "llama", "vocab_size": 128,
        "block_size": 8, "config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "num_key_value_heads": 1},
        "betas": [0.9, 0.95],
    }))
    data = instantiate(OmegaConf.create({"_target_": "recipes.data.chars.CharCorpusDataModule", "block_size": 8,
                                         "batch_size": 4, "max_chars": 2000, "shuffle": False}))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, plugins=[ParallelCheckpointIO()],
    )
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(root / "last.ckpt")
    return root / "last.ckpt", model


def test_the_allow_list_is_what_recipe_checkpoints_hold(recipe_checkpoint):
    """Every type beyond torch's defaults in a recipe checkpoint is allowed (and each allowed type is needed)."""
    path, _ = recipe_checkpoint
    needed = set(get_unsafe_globals_in_checkpoint(path))
    allowed = {"typing.Any" if t is typing.Any else f"{t.__module__}.{t.__qualname__}" for t in checkpoint_types()}
    assert needed == allowed, (needed - allowed, allowed - needed)


def test_our_checkpoints_load_without_the_opt_in(recipe_checkpoint, tmp_path, capsys):
    """weights_from of a Lightning .ckpt (full and sharded) and of a plain state dict, the CLI, and a resume's read."""
    path, trained = recipe_checkpoint
    expected = trained.state_dict()

    def fresh() -> nn.Module:
        torch.manual_seed(5)
        return type(trained)(**trained.hparams)

    assert convert(path, tmp_path / "sharded.ckpt") == "sharded"
    torch.save(trained.state_dict(), tmp_path / "plain.pt")
    for source in (path, tmp_path / "sharded.ckpt", tmp_path / "plain.pt"):
        model = fresh()
        written = load_pretrained(source, local_targets(model), None, whole_shapes=shapes_of(model))
        assert written and all(torch.equal(model.state_dict()[k], v) for k, v in expected.items()), source

    for checkpoint in (path, tmp_path / "sharded.ckpt"):
        assert checkpoint_cli(["inspect", str(checkpoint)]) == 0
        assert "global step 2" in capsys.readouterr().out
        loaded = ParallelCheckpointIO().load_checkpoint(checkpoint)  # fit(weights_only=None)
        assert list(loaded["hyper_parameters"]["betas"]) == [0.9, 0.95] and loaded["global_step"] == 2
    assert checkpoint_cli(["convert", str(tmp_path / "sharded.ckpt"), str(tmp_path / "full.ckpt")]) == 0
    assert checkpoint_cli(["inspect", str(tmp_path / "full.ckpt"), "--json"]) == 0


def test_exported_files_load_as_weights_from(recipe_checkpoint, tmp_path):
    path, trained = recipe_checkpoint
    trained.model.config.save_pretrained(tmp_path / "config")
    assert checkpoint_cli(["export", str(path), str(tmp_path / "hf"), "--config", str(tmp_path / "config" / "config.json")]) == 0
    model = type(trained)(**trained.hparams)
    load_pretrained(tmp_path / "hf", local_targets(model), None, whole_shapes=shapes_of(model))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.state_dict().items())


def test_a_damaged_checkpoint_is_still_called_damaged(tmp_path):
    """Only torch's weights-only refusals become UntrustedPickleError: a cut-short file stays a damaged one."""
    atomic_torch_save(lightning_like(nn.Linear(3, 2)), tmp_path / "a.ckpt")
    data = (tmp_path / "a.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError, match="corrupt or incomplete"):
        ParallelCheckpointIO().load_checkpoint(tmp_path / "cut.ckpt")
