"""One line at the end of training: steps, loss, throughput (samples and tokens per second, MFU), layout."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_parallel.observe.utilization import tokens_in


class TrainingSummary(Callback):
    """Reports optimizer steps, the last step's loss (averaged over data-parallel replicas), and global
    samples per second when ``fit`` ends; also sent to the Trainer's loggers under ``summary/``.

    The loss is the one ``training_step`` returned (mean over the micro-batches of the last optimizer step).
    After fit, :attr:`summary` holds the same figures as a dict.
    """

    def __init__(self) -> None:
        self.summary: dict[str, Any] = {}
        self._start_time = 0.0
        self._start_step = 0
        self._local_samples = 0
        self._local_tokens = 0
        self._step_loss_sum: torch.Tensor | None = None
        self._last_step_loss: torch.Tensor | None = None
        self._seen_step = 0

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_time = time.perf_counter()
        self._start_step = self._seen_step = trainer.global_step
        self._local_samples = self._local_tokens = 0
        self._step_loss_sum = self._last_step_loss = None

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._local_samples += extract_batch_size(batch)
        self._local_tokens += tokens_in(batch)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            # Lightning divides the returned loss by accumulate_grad_batches; summing the micro-batches of
            # one optimizer step gives that step's mean loss.
            self._step_loss_sum = loss.detach() if self._step_loss_sum is None else self._step_loss_sum + loss.detach()
        if trainer.global_step != self._seen_step:
            self._seen_step = trainer.global_step
            self._last_step_loss, self._step_loss_sum = self._step_loss_sum, None

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        elapsed = time.perf_counter() - self._start_time
        replicas = trainer.strategy.distributed_sampler_kwargs.get("num_replicas", 1) if trainer.world_size > 1 else 1
        loss = None
        if self._last_step_loss is not None:
            loss = float(trainer.strategy.reduce(self._last_step_loss, reduce_op="mean"))
        steps = trainer.global_step - self._start_step
        samples = self._local_samples * replicas
        self.summary = {
            "steps": steps,
            "loss": loss,
            "seconds": elapsed,
            "samples_per_s": samples / elapsed if elapsed > 0 else float("nan"),
            "tokens_per_s": self._local_tokens * replicas / elapsed if elapsed > 0 else float("nan"),
            "data_parallel_replicas": replicas,
            "world_size": trainer.world_size,
        }
        guard = getattr(trainer.strategy, "nonfinite", None)
        skipped = f" ({guard.skipped_steps} skipped: non-finite)" if guard is not None and guard.skipped_steps else ""
        if guard is not None:
            self.summary["skipped_steps"] = guard.skipped_steps
        layout = getattr(trainer.strategy, "layout", None)
        where = layout.describe() if layout is not None else f"{type(trainer.strategy).__name__}"
        loss_text = f"{loss:.4f}" if loss is not None else "n/a"
        mfu = _monitored_mfu(trainer)
        if mfu is not None:
            self.summary["mfu"] = mfu["mfu"]
        mfu_text = (
            f" · MFU {mfu['mfu']:.1%} of {mfu['peak_tflops_per_device']:.3g} TFLOP/s {mfu['mfu_dtype']}"
            f"{' (measured peak)' if mfu['peak_measured'] else ''} per device"
            if mfu is not None else ""
        )
        rank_zero_info(
            f"lightning_parallel summary: {steps} steps{skipped} · final loss {loss_text} · "
            f"{self.summary['samples_per_s']:.1f} samples/s, {self.summary['tokens_per_s']:.0f} tokens/s over {replicas} "
            f"replica(s){mfu_text} · {elapsed:.1f}s · {where}"
        )
        for logger in trainer.loggers:
            numeric = {f"summary/{k}": v for k, v in self.summary.items() if isinstance(v, (int, float))}
            logger.log_metrics(numeric, step=trainer.global_step)


def _monitored_mfu(trainer: Trainer) -> dict[str, Any] | None:
    """The MFU a ScalingMonitor measured (it holds the model's FLOPs and the hardware's peak), if any."""
    from lightning_parallel.observe.monitor import ScalingMonitor

    for callback in trainer.callbacks:
        if isinstance(callback, ScalingMonitor):
            measured = callback.summary.get("measured") or {}
            if "mfu" in measured:
                return measured
    return None
