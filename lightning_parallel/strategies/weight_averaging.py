"""Lightning's ``WeightAveraging`` (EMA, SWA) under every layout: the average kept like the model, shard for shard.

Lightning's callback deep-copies the LightningModule into a ``torch.optim.swa_utils.AveragedModel`` in its ``setup``,
which runs *before* the strategy's: the copy is of the whole, unsplit module on every rank (the whole model again on
each device), and every later step pairs its tensors by position with the module's as the engine has transformed it:
DTensor shards (``aten.copy_.default got mixed torch.Tensor and DTensor``), or a pipeline stage's parameters only
(``output with shape [32] doesn't match the broadcast shape [32, 32]``).

Here the engine takes the averaged copy over: the callback's ``setup`` leaves it to the engine, which builds it from
this rank's tensors once they are as they train (at the end of setup; under pipeline parallelism once the stages are
cut, on the first batch): a clone of each parameter and buffer, a DTensor shard where the module holds one, in the
module's order. Lightning's own update (``update_parameters``), swap for validation and copy at the end then run on
matching tensors. The averaged weights reach checkpoints as the module's own do (the same format, names and
conversions: they are swapped into the module while its state is read), and a resumed run puts them back into the
averaged copy and the module's own weights into the module.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost

#: Where Lightning's WeightAveraging keeps the module's own weights in a checkpoint whose ``state_dict`` holds the
#: averaged ones.
CURRENT_MODEL_KEY = "current_model_state"


class _TensorsByName(nn.Module):
    """A module's parameters and buffers under their full names, in its order (``parameters()`` and ``buffers()``
    pair with the module's by position), without its submodules or forward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        for name, param in module.named_parameters():
            self._parameters[name] = param
        for name, buffer in module.named_buffers():
            self._buffers[name] = buffer


class ParallelAveragedModel(AveragedModel):
    """``AveragedModel`` over this rank's tensors as the engine trains them (shards, a stage's), whose state is the
    engine's model state of the averaged weights (what a checkpoint of the module holding them would hold).

    Args:
        engine: The strategy training the module.
        device, use_buffers, kwargs: As for ``AveragedModel`` (Lightning's callback passes its own).
    """

    def __init__(
        self,
        engine: EngineHost,
        device: torch.device | None,
        use_buffers: bool,
        dtypes: Mapping[str, torch.dtype] | None = None,
        **kwargs: Any,
    ) -> None:
        # AveragedModel deep-copies what it is given: clones of this rank's tensors, DTensors with their placements.
        super().__init__(_TensorsByName(engine.lightning_module), device=device, use_buffers=use_buffers, **kwargs)
        self.__dict__["_engine"] = engine  # not a submodule
        for name, dtype in (dtypes or {}).items():
            self._widen(name, dtype)

    def _widen(self, name: str, dtype: torch.dtype) -> None:
        """Keep ``name``'s average in ``dtype`` where that is the more precise floating type."""
        tensors = self.module._parameters if name in self.module._parameters else self.module._buffers
        tensor = tensors.get(name)
        if tensor is None or not (tensor.is_floating_point() and dtype.is_floating_point):
            return
        if torch.finfo(dtype).bits <= torch.finfo(tensor.dtype).bits:
            return
        widened = tensor.detach().to(dtype)
        tensors[name] = nn.Parameter(widened, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else widened

    def averaged_tensors(self) -> list[Tensor]:
        return [*self.module.parameters(), *self.module.buffers()]

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        if args or kwargs:
            return super().state_dict(*args, **kwargs)
        engine = self._engine
        module = engine.lightning_module
        live, averaged = _tensors(module), self.averaged_tensors()
        with _swapped(live, averaged):
            state = engine.lightning_module_state_dict()
            # Entries that alias the module's tensors (sharded format) would read its own weights once swapped
            # back: point them at the averaged copy; gathered or converted entries are copies already.
            state = _owned(state, live, averaged)
        return {**{f"module.{name}": value for name, value in state.items()}, "n_averaged": self.n_averaged}


class WeightAveragingSupport:
    """The engine's side of Lightning's ``WeightAveraging`` callbacks (see the module doc).

    Args:
        engine: The strategy.
    """

    def __init__(self, engine: EngineHost) -> None:
        self.engine = engine
        self._callbacks: list[WeightAveraging] = []
        self._pending: dict[int, Mapping[str, Any]] = {}  # id(callback) -> checkpoint it was restored from
        self._dtypes: dict[str, torch.dtype] = {}  # the module's tensors' dtypes before the precision converted them

    def take_over(self, trainer: Trainer | None) -> None:
        """Before the callbacks' ``setup``: the averaged copies are left to the engine (built from this rank's tensors)."""
        if trainer is None:
            return
        for callback in trainer.callbacks:
            if isinstance(callback, WeightAveraging) and not any(callback is c for c in self._callbacks):
                self._callbacks.append(callback)
                _override(callback, "setup", self._setup)
                _override(callback, "on_load_checkpoint", self._on_load_checkpoint)

    def after_setup(self) -> None:
        """The end of the engine's setup (the model state loaded): build the averaged copies, unless the module is
        still to be cut into pipeline stages (then :meth:`after_stages_built`)."""
        if self.engine.pipeline_parallel.enabled and not self.engine.pipeline_parallel.staged:
            return
        self._build()

    def after_stages_built(self) -> None:
        """This rank's pipeline stages exist (the first batch): build the averaged copies from their tensors."""
        self._build()

    # ------------------------------------------------------------------ the callbacks' hooks, under the engine

    def _setup(self, original: Any, callback: WeightAveraging, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if trainer.strategy is not self.engine:
            return original(trainer, pl_module, stage)
        if stage == "fit":
            # A new average for each fit, as Lightning's: built once this rank's tensors are as they train.
            callback._average_model = None
            # Lightning's copy, made here, keeps the dtype the module has before the precision plugin converts it
            # (float32 under "bf16-true"): the average is kept in the more precise of that and the training dtype.
            self._dtypes = {name: t.dtype for name, t in itertools.chain(pl_module.named_parameters(), pl_module.named_buffers())}
            if callback._device is not None and self.engine.parameters_are_dtensors:
                device = torch.device(callback._device) if not isinstance(callback._device, int) else torch.device("cuda", callback._device)
                if device.type != self.engine.root_device.type:
                    raise ValueError(
                        f"{type(callback).__name__}(device={callback._device!r}) keeps the average on another device than the "
                        f"model, whose parameters are DTensor shards on {self.engine.root_device.type}: leave device unset "
                        "(the average is sharded like the model, so it takes each rank a share of the model's memory)."
                    )
        return None

    def _on_load_checkpoint(self, original: Any, callback: WeightAveraging, trainer: Trainer, pl_module: Any, checkpoint: Any) -> None:
        if trainer.strategy is not self.engine:
            return original(trainer, pl_module, checkpoint)
        # The engine loads the checkpoint's state_dict (the averaged weights, if WeightAveraging wrote it) into the
        # module at the end of setup; the averaged copy is built from them and the module's own loaded after.
        self._pending[id(callback)] = checkpoint
        return None

    def _build(self) -> None:
        engine = self.engine
        fitting = engine.lightning_module.trainer.state.fn == TrainerFn.FITTING
        for callback in self._callbacks:
            checkpoint = self._pending.pop(id(callback), None)
            average = callback._average_model
            if average is None:
                if not fitting:
                    continue  # as Lightning: no average outside fit (the checkpoint's state_dict is what is loaded)
                average = callback._average_model = ParallelAveragedModel(
                    engine, torch.device(callback._device) if isinstance(callback._device, str) else callback._device,
                    callback._use_buffers, self._dtypes, **callback._kwargs,
                )
            elif checkpoint is not None:
                _copy(_tensors(engine.lightning_module), average.averaged_tensors())
            # The module holds the checkpoint's state_dict, the averaged weights: the copy took them; the module's own
            # are under current_model_state.
            if (
                checkpoint is not None and "averaging_state" in checkpoint
                and engine.checkpoint_state.load_model_state_under(CURRENT_MODEL_KEY, checkpoint)
            ):
                for name, value in checkpoint["averaging_state"].items():
                    getattr(average, name).copy_(value)


def _override(callback: WeightAveraging, hook: str, replacement: Any) -> None:
    original = getattr(callback, hook)

    def hooked(self: WeightAveraging, *args: Any, **kwargs: Any) -> Any:
        return replacement(original, self, *args, **kwargs)

    setattr(callback, hook, MethodType(hooked, callback))


def _tensors(module: nn.Module) -> list[Tensor]:
    """The module's parameters and buffers in the order Lightning's WeightAveraging pairs them."""
    return list(itertools.chain(module.parameters(), module.buffers()))


@contextmanager
def _swapped(live: list[Tensor], averaged: list[Tensor]) -> Iterator[None]:
    """The averaged values in the module's tensors (and back), tensor by tensor as Lightning's ``_swap_models``."""
    _check_pairs(live, averaged)
    _swap(live, averaged)
    try:
        yield
    finally:
        _swap(live, averaged)


@torch.no_grad()
def _swap(first: list[Tensor], second: list[Tensor]) -> None:
    for a, b in zip(first, second):
        kept = a.detach().clone()
        a.detach().copy_(b.detach())
        b.detach().copy_(kept)


@torch.no_grad()
def _copy(source: list[Tensor], target: list[Tensor]) -> None:
    _check_pairs(source, target)
    for s, t in zip(source, target):
        t.detach().copy_(s.detach())


def _check_pairs(live: list[Tensor], averaged: list[Tensor]) -> None:
    if len(live) != len(averaged) or any(a.shape != b.shape for a, b in zip(live, averaged)):
        raise RuntimeError(
            "The averaged copy of WeightAveraging no longer pairs with the module's tensors (their number or shapes "
            "changed after it was built): a module changed during training is not supported with weight averaging."
        )


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _owned(state: dict[str, Any], live: list[Tensor], averaged: list[Tensor]) -> dict[str, Any]:
    """``state`` with entries aliasing a live tensor replaced by its averaged counterpart (a view of part of one is
    copied), so that it keeps the averaged values once the module has its own back."""
    exact = {(_local(t).data_ptr(), tuple(_local(t).shape), _local(t).stride()): i for i, t in enumerate(live)}
    storages = {_local(t).untyped_storage().data_ptr() for t in live if _local(t).numel()}
    owned: dict[str, Any] = {}
    for name, value in state.items():
        if not isinstance(value, Tensor):
            owned[name] = value
            continue
        local = _local(value)
        key = (local.data_ptr(), tuple(local.shape), local.stride())
        if key in exact and local.numel():
            counterpart = averaged[exact[key]].detach()
            owned[name] = counterpart if isinstance(value, DTensor) else _local(counterpart)
        elif local.numel() and local.untyped_storage().data_ptr() in storages:
            owned[name] = value.detach().clone()
        else:
            owned[name] = value
    return owned
