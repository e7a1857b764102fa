"""Train a recipe model under any strategy, chosen on the command line.

    python recipes/train.py                                               # GPT, one CPU process
    python recipes/train.py strategy=data trainer.devices=2               # 2 data-parallel replicas
    python recipes/train.py strategy=data trainer.devices=2 trainer.accumulate_grad_batches=4
    python recipes/train.py experiment=convnet_syncbn                     # BatchNorm over the global batch
    python recipes/train.py -m strategy=single,data trainer.devices=1,2   # sweep
    python recipes/train.py hydra.run.dir=outputs/gpt ckpt_path=last      # resume that run (any layout)

Global batch = data.batch_size (per rank) × data-parallel replicas × trainer.accumulate_grad_batches.
Outputs (CSV metrics, checkpoints/, Hydra config) go to outputs/<date>/<time>/ unless hydra.run.dir says.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# The recipes live beside the package, not inside it: make `recipes.*` importable for Hydra's
# `_target_`s when this file is run as a script (what rootutils does in lightning-hydra-template).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.utilities.rank_zero import (
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)
from omegaconf import DictConfig

from lightning_parallel import ScalingMonitor, latest_checkpoint, training_job
from lightning_parallel.plan.config import (
    configured_layout,
    hardware_from_config,
    preserved_random_state,
    profile_from_config,
)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Build data, model, strategy and Trainer from ``cfg`` and fit; returns the final logged metrics."""
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    strategy = instantiate(cfg.strategy)
    trainer = instantiate(cfg.trainer, strategy=strategy)
    attach_prediction(cfg, trainer)
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), Path(cfg.paths.output_dir) / "checkpoints")
    # Checkpoints of these recipes hold the Hydra config (OmegaConf objects) among the hyperparameters,
    # which torch's weights-only unpickler refuses: they are this project's own files, read in full.
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=False)
    return {key: float(value) for key, value in trainer.callback_metrics.items()}


def attach_prediction(cfg: DictConfig, trainer: L.Trainer) -> None:
    """Give the ScalingMonitor (if on) the model's dry run and the hardware, so it can print predicted vs measured.

    Only rank 0 reports, so only rank 0 profiles; the dry run leaves every random generator as it found it.
    """
    monitor = next((c for c in trainer.callbacks if isinstance(c, ScalingMonitor) and c.enabled), None)
    if monitor is None or rank_zero_only.rank != 0:
        return
    try:
        with preserved_random_state():
            monitor.hardware = hardware_from_config(cfg)
            monitor.profile = profile_from_config(cfg, {configured_layout(cfg).tp})
    except Exception as error:  # noqa: BLE001 — a model the dry run cannot handle still trains; only the prediction is missing
        rank_zero_warn(f"ScalingMonitor: no prediction ({type(error).__name__}: {error})")


def resolve_ckpt_path(ckpt_path: str | None, checkpoint_dir: Path) -> str | None:
    """``last`` -> the newest complete checkpoint in ``checkpoint_dir`` (a save cut short is skipped), else as given."""
    if ckpt_path != "last":
        return ckpt_path
    latest = latest_checkpoint(checkpoint_dir)
    if latest is None:
        rank_zero_info(f"ckpt_path=last: no complete checkpoint in {checkpoint_dir}; starting fresh.")
        return None
    rank_zero_info(f"ckpt_path=last: resuming from {latest}")
    return str(latest)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    # A multirun sweep runs several jobs in this process: each starts with a clean launch environment.
    with training_job():
        train(cfg)


if __name__ == "__main__":
    main()
