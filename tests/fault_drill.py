"""The main recipe with one rank SIGKILLed on purpose, once: the fault drill of tests/distributed/test_failures.py.

    torchrun --max-restarts 1 ... tests/fault_drill.py <recipe overrides>   (with FAULT_KILL_STEP / FAULT_KILL_RANK)

In the first attempt (``TORCHELASTIC_RESTART_COUNT=0``) the rank ``FAULT_KILL_RANK`` kills itself with SIGKILL
right before optimizer step ``FAULT_KILL_STEP``; the restarted attempt runs undisturbed.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import lightning as L
from omegaconf import DictConfig

from lightning_parallel import training_job
from lightning_parallel.strategies.launch import restart_attempt
from recipes.train import train


class KillOnce(L.Callback):
    """SIGKILL this process before global step ``step`` if it is global rank ``rank``, in the first attempt only."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if restart_attempt() == 0 and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    callbacks = []
    if "FAULT_KILL_STEP" in os.environ:
        callbacks.append(KillOnce(int(os.environ["FAULT_KILL_STEP"]), int(os.environ.get("FAULT_KILL_RANK", "1"))))
    with training_job():
        train(cfg, extra_callbacks=callbacks)


if __name__ == "__main__":
    main()
