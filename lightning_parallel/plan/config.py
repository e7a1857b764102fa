"""From a Hydra config (the same one training uses) to the planner's inputs: model profile, workload, hardware.

The model is instantiated from ``cfg.model`` on the meta device; one real batch of ``cfg.data`` gives the
shapes. The configured layout is read from ``cfg.strategy`` as the strategies would resolve it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_parallel.parallelize.tensor.apply import TensorParallelConfig
from lightning_parallel.plan.hardware import HardwareProfile
from lightning_parallel.plan.layouts import Layout, Workload
from lightning_parallel.plan.profile import ModelProfile, profile_model


def hardware_from_config(cfg: DictConfig) -> HardwareProfile:
    if "hardware" not in cfg or cfg.hardware is None:
        raise ValueError("The config has no hardware profile: add hardware=<name> (one of lightning_parallel/conf/hardware/*.yaml, or your app's own hardware/ group).")
    return HardwareProfile.from_config(OmegaConf.to_container(cfg.hardware, resolve=True))  # type: ignore[arg-type]


def world_of(cfg: DictConfig) -> tuple[int, int]:
    """(processes per node, nodes) from ``cfg.trainer``."""
    devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1)
    for name, value in (("trainer.devices", devices), ("trainer.num_nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: the planner needs a positive count of processes (not 'auto' or a list).")
    return devices, nodes


def configured_strategy(cfg: DictConfig) -> Any:
    """The strategy ``cfg.strategy`` builds (building one starts no process: it only validates its options)."""
    return instantiate(cfg.strategy)


def configured_layout(cfg: DictConfig) -> Layout | None:
    """The layout ``cfg.strategy`` asks for, resolved over the configured ranks — by the strategy itself, so
    the planner never keeps a second copy of the presets' defaults. Lightning's own strategies: dp = world.
    ``None`` for ``strategy=auto``, which leaves the layout to the planner."""
    devices, nodes = world_of(cfg)
    strategy = configured_strategy(cfg)
    if getattr(strategy, "chooses_layout", False):
        return None
    if not hasattr(strategy, "layout_for"):
        return Layout(dp=devices * nodes, tp=1, pp=1)
    layout = strategy.layout_for(devices * nodes, devices, f"trainer.devices={devices} × trainer.num_nodes={nodes}")
    return strategy.planned_layout(layout)


def pinned_sizes(cfg: DictConfig) -> dict[str, int]:
    """The sizes ``strategy=auto`` keeps (its ``pin``); nothing for strategies with a configured layout."""
    return dict(getattr(configured_strategy(cfg), "pin", None) or {})


def workload_from_config(cfg: DictConfig, global_batch: int | None = None) -> Workload:
    """Ranks and batch: by default the global batch the configured layout trains (data.batch_size × dp ×
    accumulation; ``strategy=auto``: its ``global_batch``, or data parallelism's over every rank)."""
    devices, nodes = world_of(cfg)
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    if global_batch is None:
        layout = configured_layout(cfg)
        chosen = getattr(configured_strategy(cfg), "global_batch", None) if layout is None else None
        global_batch = chosen or cfg.data.batch_size * (layout.dp if layout is not None else devices * nodes) * accumulate
    return Workload(
        devices_per_node=devices, num_nodes=nodes, global_batch=global_batch, accumulate=accumulate,
        empty_init=bool(cfg.get("empty_init", False)),
    )


def tensor_parallel_config(cfg: DictConfig) -> TensorParallelConfig:
    """The tensor-parallel plan the configured strategy would use (``auto`` for strategies without one)."""
    config = getattr(configured_strategy(cfg), "tensor_parallel_config", None)
    return config if isinstance(config, TensorParallelConfig) else TensorParallelConfig()


def example_batch(cfg: DictConfig) -> Any:
    """One training batch of ``cfg.data`` (its shapes drive the dry run)."""
    datamodule = instantiate(cfg.data)
    datamodule.prepare_data()
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


#: Parameter dtype of Lightning's "-true" precisions (mixed precisions keep float32 parameters).
_TRUE_PRECISIONS = {"64": torch.float64, "64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}


def parameter_dtype(precision: Any) -> torch.dtype | None:
    """The dtype the Trainer's ``precision`` trains parameters in (``None``: the module's own, float32)."""
    return _TRUE_PRECISIONS.get(str(precision))


def profile_from_config(cfg: DictConfig, tensor_parallel_sizes: Iterable[int]) -> ModelProfile:
    """Dry-run ``cfg.model`` on the meta device for each tensor-parallel degree, in the trainer's precision."""
    return profile_model(
        lambda: instantiate(cfg.model),
        example_batch(cfg),
        tuple(sorted(set(tensor_parallel_sizes) | {1})),
        tensor_parallel_config(cfg),
        dtype=parameter_dtype(cfg.trainer.get("precision", "32-true")),
    )


@contextmanager
def preserved_random_state() -> Iterator[None]:
    """Leave Python's, NumPy's and torch's CPU generators as they were (a dry run must not shift training's draws)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
