"""Installed as a package (issue 53): the wheel built from this checkout, installed outside it, plans and trains a
user's own model from a user's own Hydra app that names our config groups.

The wheel is built from a copy of the sources (nothing written into the checkout) and installed with
``pip install --no-deps --target``; every command then runs in a project directory of the test's own, with only that
target on ``PYTHONPATH`` (its dependencies come from this environment), so the repository's ``conf/``, ``recipes/``
and sources are out of reach: the configs must come from inside the package.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT, launch_environment

pytestmark = pytest.mark.distributed

#: The user's module: a LightningModule and its data, nothing of lightning_parallel in them.
USER_MODULE = '''
import lightning as L
import torch
from torch import nn
from torch.nn import functional as F


class TinyLM(L.LightningModule):
    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 2, lr: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                      for _ in range(depth)])
        self.head = nn.Linear(width, vocab)
        self.lr = lr

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TinyData(L.LightningDataModule):
    def __init__(self, batch_size: int = 4, vocab: int = 32, length: int = 8, samples: int = 64):
        super().__init__()
        self.batch_size, self.vocab, self.length, self.samples = batch_size, vocab, length, samples

    def train_dataloader(self):
        tokens = torch.randint(0, self.vocab, (self.samples, self.length + 1), generator=torch.Generator().manual_seed(0))
        dataset = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
        return torch.utils.data.DataLoader(dataset, batch_size=self.batch_size)
'''

#: The user's Hydra app: its own config directory, our strategy group by name (found through the package's plugin).
USER_APP = '''
import json
import sys

import hydra
from hydra.utils import instantiate


@hydra.main(version_base="1.3", config_path="app_conf", config_name="config")
def main(cfg):
    import hydra_plugins.lightning_parallel_searchpath as plugin
    import lightning_parallel

    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy))
    trainer.fit(instantiate(cfg.model), datamodule=instantiate(cfg.data))
    if trainer.global_rank == 0:
        with open(cfg.result, "w") as out:
            json.dump({"package": lightning_parallel.__file__, "plugin": plugin.__file__, "sys_path": sys.path,
                       "strategy": type(trainer.strategy).__name__, "world_size": trainer.world_size,
                       "steps": trainer.global_step, "loss": float(trainer.callback_metrics["train_loss"])}, out)


if __name__ == "__main__":
    main()
'''

USER_CONFIG = '''
defaults:
  - strategy: data          # lightning_parallel's group, not a file of this app
  - _self_

result: ???
model:
  _target_: my_model.TinyLM
data:
  _target_: my_model.TinyData
  batch_size: 4
trainer:
  _target_: lightning.pytorch.Trainer
  accelerator: cpu
  devices: 2
  max_steps: 3
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: ${hydra:runtime.output_dir}
strategy:
  timeout: 120
'''


def run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``command`` in its own session, killed whole (its ranks too) when it outlives ``timeout``."""
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{command} hung for more than {timeout}s:\n{stderr[-6000:]}") from None
    assert proc.returncode == 0, f"{command} exited {proc.returncode}:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def build_and_install(tmp_path: Path) -> Path:
    """The wheel of this checkout, installed into ``<tmp_path>/site`` (returned)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, source / name)
    for name in ("lightning_parallel", "hydra_plugins"):
        shutil.copytree(REPO_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = launch_environment()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp_path / "dist"), str(source)], tmp_path, env)
    (wheel,) = (tmp_path / "dist").glob("lightning_parallel-*.whl")
    run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)], tmp_path, env)
    return tmp_path / "site"


def test_the_wheel_plans_and_trains_a_users_model_from_a_users_hydra_app(tmp_path):
    site = build_and_install(tmp_path)
    library = REPO_ROOT / "lightning_parallel" / "conf"
    shipped = {path.relative_to(site / "lightning_parallel" / "conf") for path in (site / "lightning_parallel" / "conf").rglob("*.yaml")}
    assert shipped == {path.relative_to(library) for path in library.rglob("*.yaml")}, shipped  # every YAML, as package data
    assert (site / "hydra_plugins" / "lightning_parallel_searchpath" / "__init__.py").is_file()

    project = tmp_path / "project"
    (project / "app_conf").mkdir(parents=True)
    (project / "my_model.py").write_text(USER_MODULE)
    (project / "train.py").write_text(USER_APP)
    (project / "app_conf" / "config.yaml").write_text(USER_CONFIG)
    env = {**launch_environment(), "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}

    # The planner, from a directory without conf/config.yaml: the package's own planner config, the user's model.
    plan = run([sys.executable, "-m", "lightning_parallel.plan", "model._target_=my_model.TinyLM", "+model.depth=3",
                "data._target_=my_model.TinyData", "data.batch_size=8", "trainer.devices=4", "hardware=h100_ib",
                "--json", str(tmp_path / "plan.json")], project, env)
    report = json.loads((tmp_path / "plan.json").read_text())
    # embedding 32×16 + 3 blocks of (16→32→16) + head 16→32: the user's keyword (+model.depth=3) reached the module
    assert report["model"] == {"name": "TinyLM", "parameters": 512 + 3 * 1072 + 544, "trunk_layers": report["model"]["trunk_layers"]}
    layout = report["recommended"]["layout"]
    assert report["recommended"]["fits"] and layout["dp"] * layout["cp"] * layout["tp"] * layout["pp"] == 4
    assert report["hardware"]["name"] == "h100_ib"
    assert "run it (overrides for your Hydra app)" in plan.stdout  # no recipes/train.py outside this repository

    # Two ranks under DataParallelStrategy, composed by the user's app from our `strategy` group by name.
    result = tmp_path / "result.json"
    run([sys.executable, "train.py", f"result={result}", f"hydra.run.dir={tmp_path / 'run'}"], project, env)
    outcome = json.loads(result.read_text())
    assert Path(outcome["package"]).is_relative_to(site) and Path(outcome["plugin"]).is_relative_to(site)
    assert str(REPO_ROOT) not in outcome["sys_path"]
    assert outcome["strategy"] == "DataParallelStrategy" and outcome["world_size"] == 2 and outcome["steps"] == 3
    assert math.isfinite(outcome["loss"])
