"""Train a recipe model under any strategy, chosen on the command line.

    python recipes/train.py                                               # GPT, one CPU process
    python recipes/train.py strategy=data trainer.devices=2               # 2 data-parallel replicas
    python recipes/train.py strategy=data trainer.devices=2 trainer.accumulate_grad_batches=4
    python recipes/train.py experiment=convnet_syncbn                     # BatchNorm over the global batch
    python recipes/train.py -m strategy=data trainer.devices=1,2,4        # sweep
    python recipes/train.py hydra.run.dir=outputs/gpt ckpt_path=last      # resume that run (any layout)

Global batch = data.batch_size (per rank) × data-parallel replicas × trainer.accumulate_grad_batches.
Outputs (CSV metrics, checkpoints/, Hydra config) go to outputs/<date>/<time>/ unless hydra.run.dir says.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
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
from lightning_parallel.observe.utilization import model_flops_per_sample
from lightning_parallel.strategies.engine import ParallelEngineStrategy
from lightning_parallel.strategies.launch import restart_attempt
from recipes.callbacks import PlannedFlopsSummary

# Deprecation warnings that third-party code raises from its own calls, in the versions this project pins, and
# that no argument of ours avoids: silenced by message and emitting module only (anything else still shows).
# At module level, so the processes Lightning starts for the other ranks (they re-run this file, or import it
# under spawn) install them too.
# torchdata 0.11.0 (the newest release) calls `torch.set_vital`, a deprecated no-op since torch dropped its
# vitals, in every StatefulDataLoader's __init__ (upstream: meta-pytorch/data#1536, not fixed in a release yet);
# the recipes' loaders must be stateful to resume mid-epoch.
warnings.filterwarnings(
    "ignore", message=r"'set_vital' is deprecated", category=UserWarning,
    module=r"torchdata\.stateful_dataloader\.stateful_dataloader\Z",
)
# Lightning 2.6.6 (the newest release) builds `LeafSpec()` in its CombinedLoader's pytree copy, which torch's
# pytree deprecates for `treespec_leaf()` (Lightning-AI/pytorch-lightning#21326, unfixed in 2.6.6); every
# Trainer.fit wraps its loaders in a CombinedLoader.
warnings.filterwarnings(
    "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
    module=r"lightning\.pytorch\.utilities\._pytree\Z",
)
# The same deprecation, raised again where the pipeline runtime deep-copies a micro-batch's tree spec (the
# warning is attributed to the copy's caller, the standard library's copyreg).
warnings.filterwarnings(
    "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning, module=r"copyreg\Z",
)

# Lightning 2.6.6 advertises its cloud logger ("💡 Tip: ... try installing litlogger") on every Trainer whose loggers
# include no LitLogger: an advertisement, not about the user's run. Dropped from Lightning's rank-zero logger by its
# opening words only (any other message of that logger still shows).
class _NoLitLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip: For seamless cloud logging")


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoLitLoggerTip())


def train(cfg: DictConfig, extra_callbacks: Sequence[L.Callback] = ()) -> dict[str, Any]:
    """Build data, model, strategy and Trainer from ``cfg`` and fit; returns the final logged metrics."""
    check_single_device(cfg)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    strategy = instantiate(cfg.strategy)
    trainer = instantiate(cfg.trainer, strategy=strategy)
    empty_init = bool(cfg.get("empty_init", False))
    if empty_init and not isinstance(strategy, ParallelEngineStrategy):
        raise ValueError(
            f"empty_init=true builds the model on the meta device, which only lightning_parallel's strategies "
            f"materialise (strategy={cfg.strategy.get('_target_', cfg.strategy)!r} would train uninitialised weights). "
            "Use strategy=data|tensor|pipeline|hybrid, or empty_init=false."
        )
    with trainer.init_module(empty_init=True) if empty_init else nullcontext():
        model = instantiate(cfg.model)
    trainer.callbacks.extend(extra_callbacks)
    attach_prediction(cfg, trainer)
    ckpt_path = resolve_ckpt_path(cfg.get("ckpt_path"), Path(cfg.paths.output_dir) / "checkpoints")
    # Read without running code from the checkpoint (the OmegaConf containers among these recipes' hyperparameters
    # are allowed: lightning_parallel/checkpoint/unpickling.py); +trust_pickle=true unpickles a trusted one in full.
    trust_pickle = bool(cfg.get("trust_pickle", False))
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=not trust_pickle)
    return {key: float(value) for key, value in trainer.callback_metrics.items()}


def attach_prediction(cfg: DictConfig, trainer: L.Trainer) -> None:
    """Give the ScalingMonitor (if on) the model's dry run and the hardware, so it can print predicted vs measured,
    and the model summary (if on) the dry run's FLOPs count.

    Only rank 0 reports, so only rank 0 profiles; the dry run leaves every random generator as it found it.
    """
    monitor = next((c for c in trainer.callbacks if isinstance(c, ScalingMonitor) and c.enabled), None)
    summary = next((c for c in trainer.callbacks if isinstance(c, PlannedFlopsSummary)), None)
    if (monitor is None and summary is None) or rank_zero_only.rank != 0:
        return
    try:
        with preserved_random_state():
            if monitor is not None:
                monitor.hardware = hardware_from_config(cfg)
            layout = configured_layout(cfg)  # None: strategy=auto, whose own dry run the monitor takes at train start
            profile = profile_from_config(cfg, {layout.tp if layout is not None else 1})
    except Exception as error:  # noqa: BLE001 — a model the dry run cannot handle still trains; only the prediction is missing
        rank_zero_warn(f"ScalingMonitor: no prediction ({type(error).__name__}: {error})")
        return
    if monitor is not None:
        monitor.profile = profile
    if summary is not None:
        summary.flops_per_sample = model_flops_per_sample(profile)


def check_single_device(cfg: DictConfig) -> None:
    """Refuse ``strategy=single`` with several processes: each would train its own copy and write the same files.

    Raises:
        ValueError: More than one device configured, or a launcher (torchrun, SLURM) started several processes.
    """
    if not str(cfg.strategy.get("_target_", "")).endswith("SingleDeviceStrategy"):
        return
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    devices = cfg.trainer.get("devices", 1)
    if launched > 1 or (isinstance(devices, int) and devices > 1) or cfg.trainer.get("num_nodes", 1) > 1:
        raise ValueError(
            f"strategy=single trains on one device, but trainer.devices={devices}, trainer.num_nodes="
            f"{cfg.trainer.get('num_nodes', 1)} and {launched} launched process(es) ask for more: every process would "
            "train its own copy and write the same checkpoints. Use strategy=data (or tensor/pipeline/hybrid) for "
            "several devices, or trainer.devices=1 in a single process."
        )


def resolve_ckpt_path(ckpt_path: str | None, checkpoint_dir: Path) -> str | None:
    """``last`` -> the newest complete checkpoint in ``checkpoint_dir`` (a save cut short is skipped), else as given.

    A restarted job (torchrun ``--max-restarts``, a SLURM requeue) resumes from its newest checkpoint even
    without ``ckpt_path=last``: starting over would train again from step 0 over the files it wrote.
    """
    if ckpt_path is None and restart_attempt() > 0:
        rank_zero_info(f"Restart {restart_attempt()} of this job: resuming from its newest checkpoint (ckpt_path=last).")
        ckpt_path = "last"
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
