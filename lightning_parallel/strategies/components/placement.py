"""Where the module's tensors come to live: only this rank's part on its device, with its starting values.

A module built under ``trainer.init_module(empty_init=True)`` has its parameters on the meta device. The
tensor-parallel plan and FSDP2 split it there; this component then allocates only this rank's shards on
its device, gives them the values eager construction would have (``parallelize/placement/deferred_init.py``: the
creations recorded while the module was built replayed, ``reset_parameters()``, ``_init_weights``) and,
with ``weights_from``, reads pretrained weights into them (``checkpoint/pretrained.py``). Pipeline stages
are placed the same way when the pipeline is cut, on the first batch. A module built eagerly is split on
the host first and moved to the device afterwards, so no device holds more than its part either
(pipelines excepted: they are cut on the first batch, with the module on the device until then).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_parallel import collectives
from lightning_parallel.checkpoint.pretrained import load_pretrained
from lightning_parallel.parallelize.placement.deferred_init import (
    InitialValues,
    allocate_local,
    has_meta_tensors,
    tied_aliases,
)
from lightning_parallel.parallelize.tensor.fused import fused_layouts
from lightning_parallel.parallelize.tensor.wrapped import wrapped_names
from lightning_parallel.parallelize.pipeline.build import allocate_meta_in_place
from lightning_parallel.strategies.components.base import Component

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_parallel.strategies.host import EngineHost


#: The ways a meta-built model gets its starting values (see ModelPlacement).
INIT_VALUES = ("eager", "draw_into_shards")


class ModelPlacement(Component):
    """Allocates and initialises this rank's part of the model; loads ``weights_from`` into it.

    Args:
        engine: The strategy.
        weights_from: Pretrained weights read into this rank's tensors before training: a full checkpoint
            file, a sharded checkpoint directory of this library, or a Hugging Face model directory
            (``*.safetensors``, one file or sharded with ``model.safetensors.index.json``).
        trust_pickle: Unpickle a ``weights_from`` checkpoint in full (runs any code the file names).
        init_values: How a model built on the meta device gets its starting values: ``"eager"`` (the bits eager
            construction on the host gives, each module materialised whole on the host in turn) or
            ``"draw_into_shards"`` (the same distribution drawn straight into this rank's shards on its device,
            nothing whole anywhere: ``parallelize/placement/shard_draws.py``).
    """

    def __init__(
        self, engine: EngineHost, weights_from: str | None = None, trust_pickle: bool = False, init_values: str = "eager"
    ) -> None:
        super().__init__(engine)
        if not isinstance(trust_pickle, bool):
            raise TypeError(f"trust_pickle must be True or False, got {trust_pickle!r}.")
        if init_values not in INIT_VALUES:
            raise ValueError(f"init_values={init_values!r} is not one of {list(INIT_VALUES)}: 'eager' for eager "
                             f"construction's values, 'draw_into_shards' to draw them on each rank's shards.")
        self.init_values = init_values
        self.weights_from = weights_from
        self.trust_pickle = trust_pickle
        self.initial_values: InitialValues | None = None
        self._whole_shapes: dict[str, tuple[int, ...]] | None = None
        self._aliases: dict[str, str] = {}
        self._unwrapped_names: dict[str, str] = {}
        self._adapter_names: frozenset[str] = frozenset()
        self._construction_stream: Tensor | None = None  # the generator state to initialise from, if not the current one
        self._placed = False

    @property
    def deferred(self) -> bool:
        """Whether the module was built with its parameters on the meta device (and not yet placed)."""
        return self.initial_values is not None and not self._placed

    def prepare(self, trainer: Trainer, fitting: bool) -> None:
        module = self.engine.lightning_module
        if self._whole_shapes is not None:
            return  # set up before (fit, then validate): the module is split already
        # Recorded before any split: the whole module's names and shapes, and eager construction's order.
        self._whole_shapes = {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}
        self._aliases = tied_aliases(module)
        # Projections wrapped with adapters (peft): a source saved before wrapping names their base weights without
        # ``base_layer``, and holds no adapters (they keep their initial values, as peft leaves them on a base model).
        self._unwrapped_names, self._adapter_names = wrapped_names(module)
        if has_meta_tensors(module):
            self.initial_values = InitialValues.of(module)
            if self.engine.pipeline_parallel.enabled and self.init_values == "eager":
                # Stages are placed on the first batch, after Lightning and the data loaders have drawn random
                # numbers: keep the generator state eager construction started from, and leave it where
                # construction would have (a first pass that draws the same numbers and copies nothing).
                with rank_zero_random_stream():
                    self._construction_stream = torch.get_rng_state()
                    self.initial_values.write({})

    def apply(self, trainer: Trainer, fitting: bool) -> None:
        engine = self.engine
        if engine.pipeline_parallel.enabled:
            if not self.deferred:
                engine.model_to_device()  # a pipeline is cut on the first batch, on the device
            return
        if engine.data_parallel.shards:
            return  # FSDP2 shards the module first and calls place() (data component)
        self.place()

    def place(self) -> None:
        """Put this rank's part of the (already split) module on its device, with its starting values."""
        engine = self.engine
        module = engine.lightning_module
        if self._placed or (not self.deferred and self.weights_from is None):
            self._placed = True
            engine.model_to_device()
            return
        if self.deferred:
            allocate_local(module, engine.root_device)
        else:
            engine.model_to_device()
        self.fill(local_targets(module), fused_layouts(module))
        self._placed = True

    def allocate_outside_stages(self) -> dict[int, Tensor]:
        """A pipeline was cut (its stages' tensors allocated in the cut): give memory to the module's tensors
        outside them, if any. Returns ``id(old parameter) -> new`` for the optimizers."""
        if not self.deferred:
            return {}
        return allocate_meta_in_place(self.engine.lightning_module, self.engine.root_device)

    def place_stages(self, stage_tensors: Mapping[str, Tensor], root_name: str) -> None:
        """Starting values for this rank's pipeline stages (``stage_tensors``: names relative to ``root_name``)
        and for the module's tensors outside the pipelined module."""
        if not self.deferred and self.weights_from is None:
            return
        prefix = f"{root_name}." if root_name else ""
        targets = {prefix + name: tensor for name, tensor in stage_tensors.items()}
        outside = local_targets(self.engine.lightning_module)
        targets.update((name, t) for name, t in outside.items() if not name.startswith(prefix) and name not in targets)
        self.fill(targets)

    def fill(self, targets: Mapping[str, Tensor], fused: Mapping[str, object] | None = None) -> None:
        """Give this rank's tensors (by full name) their starting values: eager init, then ``weights_from``."""
        if self.deferred and self.init_values == "draw_into_shards":
            with rank_zero_random_stream():
                seed = int(torch.randint(0, 2**62, (1,)).item())  # the host generator's: the same on every rank
            written = self.initial_values.draw_into_shards(targets, seed, set(fused or {}))  # type: ignore[union-attr]
            rank_zero_info(f"lightning_parallel: drew {len(set(written))} tensors into this rank's shards on its device.")
        elif self.deferred:
            with rank_zero_random_stream(), _drawing_from(self._construction_stream):
                written = self.initial_values.write(targets, fused)  # type: ignore[union-attr,arg-type]
            rank_zero_info(f"lightning_parallel: initialised {len(set(written))} tensors of this rank's part of the model on its device.")
        if self.weights_from is not None:
            loaded = load_pretrained(
                self.weights_from, targets, fused, whole_shapes=self._whole_shapes or {}, aliases=self._aliases,
                unwrapped_names=self._unwrapped_names, adapters=self._adapter_names,
                trust_pickle=self.trust_pickle,
            )
            rank_zero_info(f"lightning_parallel: read {len(loaded)} tensors of this rank's part from {self.weights_from!r}.")
        self._placed = True


def local_targets(module: nn.Module) -> dict[str, Tensor]:
    """This rank's parameters and buffers by every full name (tied aliases included), as they train."""
    targets = dict(module.named_parameters(remove_duplicate=False))
    targets.update((name, b) for name, b in module.named_buffers(remove_duplicate=False) if b is not None)
    return targets


@contextmanager
def _drawing_from(state: Tensor | None) -> Iterator[None]:
    """Draw from ``state`` (if given), then give the generator its current state back."""
    if state is None:
        yield
        return
    current = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        yield
    finally:
        torch.set_rng_state(current)


@contextmanager
def rank_zero_random_stream() -> Iterator[None]:
    """Draw from rank 0's generator state on every rank (initial values must agree across ranks).

    A rank whose own state was rank 0's keeps the advanced state (as after eager construction); one that
    had its own gets it back.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    own = torch.get_rng_state()
    state = [own]  # replaced by rank 0's on every other rank (a dry run's no-op broadcast keeps this rank's)
    collectives.broadcast_object_list(state, src=0)
    same = torch.equal(state[0], own)
    torch.set_rng_state(state[0])
    try:
        yield
    finally:
        if not same:
            torch.set_rng_state(own)
