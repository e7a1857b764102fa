"""The recipe's progress bar and model summary: Lightning's rich ones, showing what this run is bounded by.

Both are presentation only. They live with the recipe, whose trainer config (``conf/trainer/cpu.yaml``) picks
them, not in the library, which configures neither.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from typing_extensions import override


class StepProgressBar(RichProgressBar):
    """Lightning's rich bar, counting optimizer steps out of ``max_steps`` when the epochs are unlimited.

    The recipes train for ``max_steps`` with ``max_epochs=-1``. Lightning 2.6.6 labels that "Epoch 0/-2"
    (``max_epochs - 1``) and counts the current epoch's batches; fixed upstream after 2.6.6 (#21925) by
    dropping the "/-2". Here the bar shows the budget instead: ``Steps · epoch 0 ━━━━ 37/200``. With a finite
    ``max_epochs`` it is Lightning's bar unchanged.
    """

    def _step_budget(self) -> int | None:
        trainer = self.trainer
        unlimited_epochs = trainer.max_epochs is None or trainer.max_epochs < 0
        return trainer.max_steps if unlimited_epochs and trainer.max_steps > 0 else None

    @property
    @override
    def total_train_batches(self) -> int | float:
        budget = self._step_budget()
        return super().total_train_batches if budget is None else budget

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self._step_budget() is None:
            return super()._get_train_description(current_epoch)
        description = f"Steps · epoch {current_epoch}"
        return f"{description:{len(self.validation_description)}}"  # as wide as "Validation": no flicker

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)  # resets the bar to 0 at each epoch
        if self._step_budget() is not None:
            self._update(self.train_progress_bar_id, trainer.global_step)  # the budget runs across epochs (and resumes)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step_budget() is not None:
            batch_idx = trainer.global_step - 1  # Lightning's bar shows batch_idx + 1: here, optimizer steps done
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class PlannedFlopsSummary(RichModelSummary):
    """Lightning's rich model summary with the planner's FLOPs count instead of a column of zeros.

    Lightning 2.6 counts FLOPs by running ``example_input_array`` under ``FlopCounterMode`` at fit start. The
    recipe models define none: that forward pass, outside the strategy's step, would need every tensor-parallel
    rank to join it and cannot run on a pipeline stage. So every row read 0. The planner has already counted
    the model (its meta-device dry run, the one the ScalingMonitor predicts from); ``recipes/train.py`` hands
    that count to :attr:`flops_per_sample`, shown below the table. The per-module FLOPs column is left out:
    without a forward pass there is no honest per-row figure. A model that defines ``example_input_array``
    gets Lightning's summary, with its measured column.
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth, **summarize_kwargs)
        self.flops_per_sample: float | None = None  # forward + backward of the whole model, from the planner

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._max_depth or pl_module.example_input_array is not None:
            super().on_fit_start(trainer, pl_module)
            return
        summary = self._summary(trainer, pl_module)
        if trainer.is_global_zero:
            self._print(summary, self.flops_per_sample)

    def _print(self, summary: Any, flops_per_sample: float | None) -> None:
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary._get_summary_data() if name != "FLOPs"]
        table = Table(header_style=self._summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            left = name in (" ", "Name", "Type", "Mode")
            table.add_column(name, justify="left" if left else "right", style="dim" if name == " " else None, no_wrap=name == "Name")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)

        trainable, total = summary.trainable_parameters, summary.total_parameters
        modes = summary.total_training_modes
        grid = Table.grid(expand=True)
        grid.add_column()
        grid.add_row(f"[bold]Trainable params[/]: {get_human_readable_count(int(trainable))}")
        grid.add_row(f"[bold]Non-trainable params[/]: {get_human_readable_count(int(total - trainable))}")
        grid.add_row(f"[bold]Total params[/]: {get_human_readable_count(int(total))}")
        grid.add_row(f"[bold]Total estimated model params size (MB)[/]: {get_formatted_model_size(summary.model_size)}")
        grid.add_row(f"[bold]Modules in train mode[/]: {modes['train']}")
        grid.add_row(f"[bold]Modules in eval mode[/]: {modes['eval']}")
        if flops_per_sample:
            grid.add_row(
                f"[bold]Training FLOPs per sample[/]: {get_human_readable_count(int(flops_per_sample))} "
                "(planner's count: forward + backward)"
            )
        console = get_console()
        console.print(table)
        console.print(grid)
