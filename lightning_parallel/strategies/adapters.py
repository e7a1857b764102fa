"""Save the adapters of a peft model trained under any layout, in peft's own format.

``save_adapters(trainer, directory)`` writes what ``PeftModel.save_pretrained`` writes (``adapter_config.json`` and
``adapter_model.safetensors``), loadable with ``PeftModel.from_pretrained(base_model, directory)``, from a model
split by tensor parallelism, sharded by FSDP2 or cut into pipeline stages: only the trainable tensors (the adapters,
a few per cent of the model) are gathered whole, onto global rank 0, which writes them through peft itself. The
frozen base weights are never gathered; they stay where ``weights_from`` read them from.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from lightning_parallel.checkpoint.state import gather_pipeline_parts
from lightning_parallel.strategies.collectives import whole


def find_peft_model(module: nn.Module) -> tuple[str, nn.Module]:
    """``(name, module)`` of the peft model inside ``module``: the outermost submodule with ``peft_config`` and
    ``save_pretrained`` (what ``get_peft_model`` returns).

    Raises:
        TypeError: ``module`` holds none.
    """
    for name, sub in module.named_modules():
        if hasattr(sub, "peft_config") and callable(getattr(sub, "save_pretrained", None)):
            return name, sub
    raise TypeError(
        f"save_adapters: {type(module).__name__} holds no peft model (a module with peft_config and save_pretrained, "
        f"as peft.get_peft_model returns). Wrap the model with get_peft_model, or save a checkpoint with "
        f"trainer.save_checkpoint instead."
    )


def save_adapters(trainer: Any, directory: str | os.PathLike, **save_pretrained: Any) -> Path:
    """Write the trained adapters of the LightningModule's peft model to ``directory`` in peft's format.

    Call it on every rank (after ``trainer.fit``, or in a callback's hook that runs on every rank): the adapters'
    parts are gathered whole onto global rank 0, which writes them. Extra keyword arguments go to peft's
    ``save_pretrained`` (``safe_serialization``, ``selected_adapters``, ...).

    Returns:
        ``directory`` as a ``Path`` (on every rank; only rank 0 writes).

    Raises:
        TypeError: The LightningModule holds no peft model.
        RuntimeError: Called before the trainer has a model.
    """
    module = trainer.lightning_module
    if module is None:
        raise RuntimeError("save_adapters: the trainer has no model yet; call it after trainer.fit(...).")
    prefix, peft_model = find_peft_model(module)
    prefix = f"{prefix}." if prefix else ""
    # Trainable tensors only: the adapters (and modules_to_save); frozen base weights are never gathered. Sorted, so
    # that every rank gathers its DTensors in one order.
    parts = {name[len(prefix):]: whole(param.detach()).cpu() for name, param in sorted(module.named_parameters())
             if param.requires_grad and name.startswith(prefix)}
    runner = getattr(trainer.strategy, "pipeline_runner", None)
    if runner is not None:  # each rank holds its stages' adapters: merged onto the first stage's rank
        parts = gather_pipeline_parts(parts, runner.pp_group)
    directory = Path(directory)
    if trainer.global_rank == 0:
        state: dict[str, Tensor] = parts
        peft_model.save_pretrained(str(directory), state_dict=state, **save_pretrained)
    trainer.strategy.barrier("save_adapters")
    return directory
