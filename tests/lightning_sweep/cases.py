"""What the sweep runs: a tiny GPT and its data, and one case per Lightning callback or utility.

A case adds its callbacks (or calls its utility) to the same float64 training of the same model, as a user would on
one device, and says what it observes: numbers every rank must see as one device does (``observe``: JSON-able), and,
unless the case changes the batches on purpose, the training itself (losses, gradients and weights after every step,
collected by :class:`tests.harness.Recorder` on rank 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch import callbacks as cb
from lightning.pytorch.loggers import Logger
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader, TensorDataset

from recipes.models.gpt import GPTLightningModule

VOCAB, SEQ, EMBD, LAYERS = 32, 8, 16, 2
GLOBAL_BATCH = 8  # rows per optimizer step (per replica: GLOBAL_BATCH / dp)
VAL_SIZE = 16
LR = 0.1


class SweepGPT(GPTLightningModule):
    """The recipe GPT, tiny, with plain SGD (a 1e-6 comparison stays meaningful) and what some cases need: a step
    scheduler, Lightning's ``grad_norm`` logged, a planned failure, a ``backbone`` for BackboneFinetuning."""

    def __init__(self, scheduler: bool = False, log_grad_norm: bool = False, fail_at: int | None = None, lr: float = LR) -> None:
        super().__init__(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=2, n_embd=EMBD, lr=lr)
        self.use_scheduler, self.log_grad_norm, self.fail_at = scheduler, log_grad_norm, fail_at
        self.norms: list[dict[str, float]] = []

    @property
    def backbone(self) -> torch.nn.Module:
        """The first block (a property, not a submodule: the state's names stay the model's)."""
        return self.model.blocks[0]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_at is not None and batch_idx == self.fail_at:
            raise PlannedStop(f"stopped on purpose at batch {batch_idx}")
        return super().training_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.log_grad_norm:
            norms = grad_norm(self, norm_type=2)
            self.log_dict(norms)
            self.norms.append({k: float(v) for k, v in norms.items()})

    def configure_optimizers(self) -> Any:
        # What fine-tuning users write: frozen parameters (BackboneFinetuning) stay out until unfrozen.
        optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)
        if not self.use_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PlannedStop(Exception):
    """Raised by the module on purpose (OnExceptionCheckpoint's case)."""


class SweepData(L.LightningDataModule):
    """Random tokens, the same on every rank; ``batch_size`` is per replica (what BatchSizeFinder scales)."""

    def __init__(self, batch_size: int, train_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        tokens = torch.randint(0, VOCAB, (train_size + VAL_SIZE, SEQ + 1), generator=torch.Generator().manual_seed(0))
        self.train = TensorDataset(tokens[:train_size, :-1], tokens[:train_size, 1:])
        self.val = TensorDataset(tokens[train_size:, :-1], tokens[train_size:, 1:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)


class MemoryLogger(Logger):
    """Every metric logged, on every rank (Lightning's loggers write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append({k: float(v) for k, v in metrics.items()})

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def values(self, key: str) -> list[float]:
        return [m[key] for m in self.metrics if key in m]


@dataclass
class Context:
    """What a case's functions see: its directory, its callbacks, the logger."""

    root: Path
    callbacks: list[Any] = field(default_factory=list)
    logger: MemoryLogger = field(default_factory=MemoryLogger)
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class Case:
    """One row of the table.

    Args:
        what: What the user writes (the table's first column).
        callbacks: The callbacks, built in the cell's directory.
        trainer: Trainer arguments beyond the common ones.
        module: SweepGPT arguments.
        train_size: Training rows (GLOBAL_BATCH of them per step).
        run: What the user calls (default: ``trainer.fit``).
        observe: Numbers every rank must see as one device does (after ``run``; may be collective).
        compare_training: Whether the steps themselves are compared (not where the case changes the batches).
    """

    what: str
    callbacks: Callable[[Context], list[Any]] = lambda ctx: []
    trainer: dict[str, Any] = field(default_factory=dict)
    module: dict[str, Any] = field(default_factory=dict)
    train_size: int = 4 * GLOBAL_BATCH
    run: Callable[[L.Trainer, SweepGPT, SweepData, Context], None] | None = None
    observe: Callable[[L.Trainer, SweepGPT, SweepData, Context], dict[str, Any]] = lambda *a: {}
    compare_training: bool = True


def whole_state_sums(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's sum and absolute sum (a checkpoint's or a module's whole state, compared by name)."""
    out = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            out[f"{name}:sum"] = float(value.double().sum())
            out[f"{name}:abs"] = float(value.double().abs().sum())
    return out


def module_whole_state(trainer: L.Trainer, module: L.LightningModule) -> dict[str, float]:
    """The module's whole state after the run, by single-device names (collective: gathers shards and stages)."""
    from tests.harness import _whole_across_stages, full

    state = {k: full(v).detach().clone() for k, v in module.state_dict().items()}
    whole = _whole_across_stages(trainer, state)
    if torch.distributed.is_initialized() and getattr(trainer.strategy, "pipeline_runner", None) is not None:
        # The merge lands on the first stage's ranks: hand it to every rank.
        holder = [whole if trainer.global_rank == 0 else None]
        torch.distributed.broadcast_object_list(holder, src=0)
        whole = holder[0]
    return whole_state_sums(whole)


def checkpoint_sums(path: str | Path) -> dict[str, float]:
    from lightning_parallel.checkpoint.sharded import read_whole

    path = Path(path)
    checkpoint = read_whole(path) if path.is_dir() else torch.load(path, weights_only=False)
    return {"global_step": checkpoint["global_step"], **whole_state_sums(checkpoint["state_dict"])}


def _fit(trainer: L.Trainer, model: SweepGPT, data: SweepData, ctx: Context) -> None:
    trainer.fit(model, datamodule=data)


def _fit_until_planned_stop(trainer: L.Trainer, model: SweepGPT, data: SweepData, ctx: Context) -> None:
    try:
        trainer.fit(model, datamodule=data)
    except PlannedStop:
        ctx.notes["stopped"] = True


def _summary(max_depth: int) -> Callable[..., dict[str, Any]]:
    def observe(trainer: L.Trainer, model: SweepGPT, data: SweepData, ctx: Context) -> dict[str, Any]:
        counts = ctx.notes["summary"]
        return {**counts, "size_mb": round(counts["size_mb"], 9)}

    return observe


class RecordingSummary(cb.ModelSummary):
    """Lightning's ModelSummary; the numbers it prints (on rank 0), as every rank computes them."""

    def __init__(self, notes: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.notes = notes

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record(trainer, pl_module)
        super().on_fit_start(trainer, pl_module)

    def record(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        summary = self._summary(trainer, pl_module)
        self.notes["summary"] = {
            "total": summary.total_parameters, "trainable": summary.trainable_parameters, "size_mb": summary.model_size,
            "layers": {name: int(n) for name, n in zip(summary.layer_names, summary.param_nums)},
        }


class RecordingRichSummary(cb.RichModelSummary):
    """Lightning's RichModelSummary, recording as :class:`RecordingSummary` does."""

    def __init__(self, notes: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.notes = notes

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        RecordingSummary.record(self, trainer, pl_module)
        super().on_fit_start(trainer, pl_module)


class RowWriter(cb.BasePredictionWriter):
    """Each predicted row's sum, by dataset index (each replica writes its own rows)."""

    def __init__(self, notes: dict[str, Any]) -> None:
        super().__init__(write_interval="batch")
        self.notes = notes

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx) -> None:
        from tests.harness import full

        rows = self.notes.setdefault("rows", {})
        for index, row in zip(batch_indices, full(prediction)):
            rows[str(int(index))] = float(row.double().sum())


def _lr_finder_observe(finder: Any) -> dict[str, Any]:
    return {"lr": [float(x) for x in finder.results["lr"]], "loss": [float(x) for x in finder.results["loss"]],
            "suggestion": float(finder.suggestion() or 0.0)}


def _tuner_lr_find(trainer: L.Trainer, model: SweepGPT, data: SweepData, ctx: Context) -> None:
    finder = Tuner(trainer).lr_find(model, datamodule=data, min_lr=1e-3, max_lr=1.0, num_training=14, early_stop_threshold=None)
    ctx.notes["finder"] = _lr_finder_observe(finder)


def _tuner_scale_batch_size(trainer: L.Trainer, model: SweepGPT, data: SweepData, ctx: Context) -> None:
    found = Tuner(trainer).scale_batch_size(model, datamodule=data, mode="power", steps_per_trial=1, init_val=2, max_trials=2)
    ctx.notes["found"] = int(found)


def _predict(trainer: L.Trainer, model: SweepGPT, data: SweepData, ctx: Context) -> None:
    trainer.predict(model, datamodule=data, return_predictions=False)


def _samples_per_batch(ctx: Context) -> dict[str, Any]:
    """The global samples per batch ThroughputMonitor reports (samples/s over batches/s): one device's 8 rows."""
    out = []
    for m in ctx.logger.metrics:
        if "train/device/batches_per_sec" in m:
            samples = m.get("train/samples_per_sec", m["train/device/samples_per_sec"])
            out.append(round(samples / m["train/device/batches_per_sec"], 6))
    return {"samples_per_batch": out} if out else {}


def _rate_by_parameter(trainer: L.Trainer, module: SweepGPT) -> dict[str, float]:
    """The learning rate of each parameter this rank's optimizer holds, by name (frozen ones: absent)."""
    rates = {}
    for group in trainer.optimizers[0].param_groups:
        held = {id(p) for p in group["params"]}
        rates.update({name: group["lr"] for name, p in module.named_parameters() if id(p) in held})
    return rates


def _ema(**kwargs: Any) -> Callable[[Context], list[Any]]:
    return lambda ctx: [cb.EMAWeightAveraging(**kwargs)]


def _stepping_batches(trainer: L.Trainer, model: SweepGPT, data: SweepData, ctx: Context) -> dict[str, Any]:
    return {"estimated_stepping_batches": ctx.notes["estimated"], "global_step": trainer.global_step}


def _note_estimate(ctx: Context) -> list[Any]:
    return [cb.LambdaCallback(on_train_start=lambda trainer, module: ctx.notes.update(estimated=int(trainer.estimated_stepping_batches)))]


EPOCHS_2 = {"max_epochs": 2, "max_steps": -1}

#: name -> case, in the table's order.
CASES: dict[str, Case] = {
    "model_checkpoint": Case(
        "`ModelCheckpoint(monitor=\"val/loss\", save_top_k=1)`: the best score, the best file's weights",
        callbacks=lambda ctx: [cb.ModelCheckpoint(dirpath=ctx.root / "ckpt", monitor="val/loss", save_top_k=1)],
        trainer={"val_check_interval": 2, "enable_checkpointing": True},
        observe=lambda t, m, d, ctx: {"best_model_score": float(ctx.callbacks[0].best_model_score),
                                      **checkpoint_sums(ctx.callbacks[0].best_model_path)},
    ),
    "early_stopping": Case(
        "`EarlyStopping(monitor=\"val/loss\", patience=0, min_delta=1.0)`: stops at the same step",
        callbacks=lambda ctx: [cb.EarlyStopping(monitor="val/loss", patience=0, min_delta=1.0)],
        trainer={"val_check_interval": 2, "max_steps": 8}, train_size=8 * GLOBAL_BATCH,
        observe=lambda t, m, d, ctx: {"global_step": t.global_step, "best_score": float(ctx.callbacks[0].best_score),
                                      "wait_count": ctx.callbacks[0].wait_count},
    ),
    "lr_monitor": Case(
        "`LearningRateMonitor(logging_interval=\"step\")` with a StepLR scheduler: the logged rates",
        callbacks=lambda ctx: [cb.LearningRateMonitor(logging_interval="step")], module={"scheduler": True},
        observe=lambda t, m, d, ctx: {"lr": ctx.logger.values("lr-SGD")},
    ),
    "model_summary": Case(
        "`ModelSummary(max_depth=-1)`: total, trainable, size and each layer's parameter count, on every rank",
        callbacks=lambda ctx: [RecordingSummary(ctx.notes, max_depth=-1)], observe=_summary(-1),
    ),
    "rich_model_summary": Case(
        "`RichModelSummary()` and `RichProgressBar()`: the same counts",
        callbacks=lambda ctx: [RecordingRichSummary(notes=ctx.notes), cb.RichProgressBar()],
        trainer={"enable_progress_bar": True}, observe=_summary(1),
    ),
    "progress_bar": Case("`TQDMProgressBar()`", callbacks=lambda ctx: [cb.TQDMProgressBar()], trainer={"enable_progress_bar": True}),
    "backbone_finetuning": Case(
        "`BackboneFinetuning(unfreeze_backbone_at_epoch=1)` (BaseFinetuning's freeze, then unfreeze into a new group)",
        callbacks=lambda ctx: [cb.BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
        trainer=EPOCHS_2, train_size=2 * GLOBAL_BATCH,
        # Each parameter's rate (the unfrozen backbone joins at a tenth), over the ranks that hold it (a stage's under pp).
        observe=lambda t, m, d, ctx: {"rows": _rate_by_parameter(t, m)},
    ),
    "gradient_accumulation_scheduler": Case(
        "`GradientAccumulationScheduler({1: 2})`: accumulation 1 in epoch 0, then 2",
        callbacks=lambda ctx: [cb.GradientAccumulationScheduler({1: 2})], trainer=EPOCHS_2,
        observe=lambda t, m, d, ctx: {"global_step": t.global_step},
    ),
    "stochastic_weight_averaging": Case(
        "`StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)`: the weights after fit",
        callbacks=lambda ctx: [cb.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)],
        trainer=EPOCHS_2, train_size=2 * GLOBAL_BATCH,
        observe=lambda t, m, d, ctx: module_whole_state(t, m),
    ),
    "ema_weight_averaging": Case(
        "`EMAWeightAveraging(decay=0.5)`: the weights after fit (averaged)", callbacks=_ema(decay=0.5),
        observe=lambda t, m, d, ctx: module_whole_state(t, m),
    ),
    "weight_averaging": Case(
        "`WeightAveraging()` (equal averages, torch's SWA update): the weights after fit",
        callbacks=lambda ctx: [cb.WeightAveraging()], observe=lambda t, m, d, ctx: module_whole_state(t, m),
    ),
    "model_pruning": Case(
        "`ModelPruning(\"l1_unstructured\", amount=0.5)` (global over every layer, at each epoch's end)",
        callbacks=lambda ctx: [cb.ModelPruning("l1_unstructured", amount=0.5)],
        trainer=EPOCHS_2, train_size=2 * GLOBAL_BATCH, observe=lambda t, m, d, ctx: module_whole_state(t, m),
    ),
    "model_pruning_no_reset": Case(
        "the same with `use_lottery_ticket_hypothesis=False`",
        callbacks=lambda ctx: [cb.ModelPruning("l1_unstructured", amount=0.5, use_lottery_ticket_hypothesis=False)],
        trainer=EPOCHS_2, train_size=2 * GLOBAL_BATCH, observe=lambda t, m, d, ctx: module_whole_state(t, m),
    ),
    "timer": Case(
        "`Timer(duration=\"00:00:05:00\")`", callbacks=lambda ctx: [cb.Timer(duration="00:00:05:00")],
        observe=lambda t, m, d, ctx: {"timed": ctx.callbacks[0].time_elapsed("train") > 0},
    ),
    "lambda_callback": Case(
        "`LambdaCallback(on_train_batch_end=...)`",
        callbacks=lambda ctx: [cb.LambdaCallback(on_train_batch_end=lambda *a: ctx.notes.update(calls=ctx.notes.get("calls", 0) + 1))],
        observe=lambda t, m, d, ctx: {"calls": ctx.notes["calls"]},
    ),
    "device_stats_monitor": Case(
        "`DeviceStatsMonitor(cpu_stats=True)`", callbacks=lambda ctx: [cb.DeviceStatsMonitor(cpu_stats=True)],
        observe=lambda t, m, d, ctx: {"logged": any(any("cpu" in k.lower() for k in x) for x in ctx.logger.metrics)},
    ),
    "throughput_monitor": Case(
        "`ThroughputMonitor(batch_size_fn=len of the batch)`: global samples per batch",
        callbacks=lambda ctx: [cb.ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2)],
        observe=lambda t, m, d, ctx: _samples_per_batch(ctx),
    ),
    "spike_detection": Case(
        "`SpikeDetection(warmup=2, window=2)`", callbacks=lambda ctx: [cb.SpikeDetection(warmup=2, window=2, exclude_batches_path=str(ctx.root / "spikes.json"))],
        observe=lambda t, m, d, ctx: {"global_step": t.global_step},
    ),
    "on_exception_checkpoint": Case(
        "`OnExceptionCheckpoint(dirpath)`: the checkpoint written when training raises at batch 2",
        callbacks=lambda ctx: [cb.OnExceptionCheckpoint(dirpath=ctx.root / "on_exception")],
        module={"fail_at": 2}, trainer={"enable_checkpointing": True}, run=_fit_until_planned_stop, compare_training=False,
        observe=lambda t, m, d, ctx: {"stopped": ctx.notes.get("stopped", False), **checkpoint_sums(ctx.callbacks[0].ckpt_path)},
    ),
    "prediction_writer": Case(
        "`BasePredictionWriter` subclass with `trainer.predict`: every row's prediction",
        callbacks=lambda ctx: [RowWriter(ctx.notes)], run=_predict, compare_training=False,
        observe=lambda t, m, d, ctx: {"rows": ctx.notes.get("rows", {})},
    ),
    "batch_size_finder": Case(
        "`BatchSizeFinder(mode=\"power\", init_val=2, max_trials=2)`: the batch size found (per device, as Lightning's)",
        callbacks=lambda ctx: [cb.BatchSizeFinder(mode="power", steps_per_trial=1, init_val=2, max_trials=2)],
        compare_training=False, observe=lambda t, m, d, ctx: {"batch_size": d.batch_size},
    ),
    "tuner_scale_batch_size": Case(
        "`Tuner(trainer).scale_batch_size(mode=\"power\", init_val=2, max_trials=2)`",
        run=_tuner_scale_batch_size, compare_training=False, observe=lambda t, m, d, ctx: {"found": ctx.notes["found"]},
    ),
    "learning_rate_finder": Case(
        "`LearningRateFinder(num_training_steps=14)`: the rates, losses and suggestion",
        callbacks=lambda ctx: [cb.LearningRateFinder(min_lr=1e-3, max_lr=1.0, num_training_steps=14, early_stop_threshold=None)],
        compare_training=False, observe=lambda t, m, d, ctx: _lr_finder_observe(ctx.callbacks[0].optimal_lr),
    ),
    "tuner_lr_find": Case(
        "`Tuner(trainer).lr_find(num_training=14)`", run=_tuner_lr_find, compare_training=False,
        observe=lambda t, m, d, ctx: ctx.notes["finder"],
    ),
    "grad_norm": Case(
        "`self.log_dict(grad_norm(self, norm_type=2))` in `on_before_optimizer_step`: every norm, every rank",
        module={"log_grad_norm": True}, observe=lambda t, m, d, ctx: {"norms": m.norms},
    ),
    "estimated_stepping_batches": Case(
        "`trainer.estimated_stepping_batches` (accumulation 2)", callbacks=_note_estimate,
        trainer={"accumulate_grad_batches": 2}, train_size=8 * GLOBAL_BATCH, observe=_stepping_batches,
    ),
}
