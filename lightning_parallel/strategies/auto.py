"""``AutoParallelStrategy``: the planner chooses the layout at launch, for this model, these ranks, this hardware."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_parallel import collectives
from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallelize.common.activation_checkpointing import normalize_patterns
from lightning_parallel.plan.hardware import HardwareProfile
from lightning_parallel.plan.layouts import Layout, Workload
from lightning_parallel.strategies.hybrid import HybridParallelStrategy
from lightning_parallel.strategies.launch import make_launcher

#: HybridParallelStrategy options the planner decides (the user pins sizes with ``pin``).
CHOSEN_OPTIONS = (
    "data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size",
    "expert_parallel_size", "data_parallel_mode", "data_parallel_shard_size", "schedule", "microbatches", "stages_per_rank",
    "activation_checkpointing",
)
#: Sizes ``pin`` may fix, in the planner's names.
PINNABLE = ("dp", "cp", "tp", "pp", "ep")


class AutoParallelStrategy(HybridParallelStrategy):
    """Chooses data × context × tensor × pipeline sizes (and schedule, micro-batches, sharding, checkpointing) at
    launch, then trains exactly as :class:`HybridParallelStrategy` with them.

    On rank 0, before any process group exists, the planner dry-runs a meta-device copy of the LightningModule on
    one training batch for every tensor-parallel degree the ranks allow, predicts memory and step time of every
    layout on ``hardware``, and takes the fastest predicted one that fits in memory and that the strategy can run
    (the planner's ranking, :mod:`lightning_parallel.plan`). The choice is broadcast, so every rank trains the same
    layout; it is logged with its predicted figures and reasons, and the ScalingMonitor compares it with the
    measured step at the end. The decision is made once per strategy object (a later ``trainer.test`` reuses it).

    The global batch stays what data parallelism over all ranks trains (``batch_size × ranks ×
    accumulate_grad_batches``) unless ``global_batch`` says otherwise: the per-replica batch is then set through
    Lightning's ``batch_size`` convention (an attribute or hyperparameter of the LightningModule or its
    LightningDataModule, as for Lightning's batch-size finder), so the training math does not depend on the layout.

    Args:
        hardware: The device and network to plan for: a :class:`HardwareProfile` or its mapping (a
            ``lightning_parallel/conf/hardware/*.yaml``). Required: the planner predicts for this machine, not a default one.
        pin: Sizes the user fixes, e.g. ``{"tp": 2}`` (keys ``dp``, ``cp``, ``tp``, ``pp``, ``ep``; context
            parallelism is considered only when pinned; expert parallelism, a part of dp, wherever the model holds
            routed experts); the planner chooses the rest.
        global_batch: Samples per optimizer step (default: ``batch_size × ranks × accumulate_grad_batches``).
        **options: Any other :class:`HybridParallelStrategy` option (``plan``, ``sequence_parallel``, ``balance``,
            ``nonfinite``, ``save_format``, ...); the options the planner decides are refused.

    Example:
        >>> Trainer(devices=8, strategy=AutoParallelStrategy(hardware=profile, pin={"tp": 2}))  # doctest: +SKIP
    """

    chooses_layout = True

    def __init__(
        self,
        hardware: HardwareProfile | Mapping[str, Any] | None = None,
        pin: Mapping[str, int] = MappingProxyType({}),
        global_batch: int | None = None,
        **options: Any,
    ) -> None:
        chosen = sorted(set(options) & set(CHOSEN_OPTIONS))
        if chosen:
            raise TypeError(
                f"AutoParallelStrategy chooses {', '.join(chosen)} itself. Pin a size with pin={{'tp': 2}} (keys "
                f"{', '.join(PINNABLE)}), or use HybridParallelStrategy to set the whole layout."
            )
        super().__init__(**options)
        self.hardware = _hardware(hardware)
        self.pin = _pin(pin)
        if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1):
            raise ValueError(f"global_batch={global_batch!r} must be a positive int (samples per optimizer step) or None.")
        self.global_batch = global_batch
        self.choice: Any = None  # rank 0: the planner's Choice (prediction, plan, model profile)
        self._decision: dict[str, Any] | None = None  # every rank: the chosen layout and batch size

    @property
    def model_profile(self) -> Any:
        """The dry run the choice was made on (rank 0; ``None`` elsewhere and before launch)."""
        return self.choice.profile if self.choice is not None else None

    @override
    def _configure_launcher(self) -> None:
        # The layout is not known yet: start the processes with the placeholder (every rank a replica), unchecked.
        if self.cluster_environment is None:
            raise RuntimeError("The Trainer must connect a cluster environment before the launcher is configured.")
        self._layout = self.layout_for(self.num_nodes * self.num_processes, self.num_processes)
        self._launcher = make_launcher(self, self._start_method, self.cluster_environment)

    @override
    def setup_environment(self) -> None:
        self._prepare_process()
        proposal = None
        if self._decision is None and self.global_rank == 0:
            proposal = self._propose()  # before the process group: the dry run uses fake ones of its own
        self._init_process_group()
        if self._decision is None:
            self._decision = self._share(proposal)
        self._adopt(self._decision)
        self._build_mesh()

    # ------------------------------------------------------------------ the decision

    def _propose(self) -> dict[str, Any]:
        """Rank 0: plan, and return the decision (or the error every rank must raise)."""
        from lightning_parallel.plan.choose import choose_layout
        from lightning_parallel.plan.config import parameter_dtype, preserved_random_state

        try:
            if dist.is_initialized():
                raise RuntimeError(
                    "strategy=auto plans before this process joins a process group (the dry run makes fake ones of its "
                    "own), but one exists already: an earlier fit in this process. Start a fresh process, or train "
                    "with HybridParallelStrategy and the layout `python -m lightning_parallel.plan` recommends."
                )
            trainer = self.lightning_module.trainer
            with preserved_random_state():
                batch = _example_batch(trainer)
                per_rank = _batch_size(self.lightning_module, batch)
                world = self.num_nodes * self.num_processes
                workload = Workload(
                    devices_per_node=self.num_processes, num_nodes=self.num_nodes,
                    global_batch=self.global_batch or per_rank * world * trainer.accumulate_grad_batches,
                    accumulate=trainer.accumulate_grad_batches,
                    empty_init=any(p.is_meta for p in self.lightning_module.parameters()),
                )
                choice = choose_layout(
                    self.lightning_module, batch, workload, self.hardware, self.pin, self.tensor_parallel_config,
                    parameter_dtype(trainer.precision), refuse=self._refusal,
                )
            if choice.prediction.batch_size != per_rank and not lightning_hasattr(self.lightning_module, "batch_size"):
                raise ValueError(
                    f"strategy=auto chose {choice.layout.describe()}, which trains {choice.prediction.batch_size} samples "
                    f"per replica to keep the global batch {workload.global_batch}, but the dataloader's batch of "
                    f"{per_rank} cannot be changed: give the LightningModule or its LightningDataModule a `batch_size` "
                    "attribute (or hyperparameter) that its train_dataloader reads, or pin dp to all ranks (pin={'dp': "
                    f"{world}}})."
                )
        except Exception as error:  # noqa: BLE001 — any failure here must reach every rank, or they wait at the rendezvous
            return {"error": f"{type(error).__name__}: {error}"}
        self.choice = choice
        return {"layout": choice.layout.as_dict(), "batch_size": choice.prediction.batch_size,
                "per_rank": per_rank, "report": choice.report()}

    def _refusal(self, layout: Layout) -> str | None:
        try:
            self._adopt({"layout": layout.as_dict()}, announce=False)
            self._validate(self.layout_for(layout.world_size, self.num_processes))
        except (ValueError, TypeError) as error:
            return str(error)
        return None

    def _share(self, proposal: dict[str, Any] | None) -> dict[str, Any]:
        """Every rank receives rank 0's decision; an error there is raised on every rank (no rank waits forever)."""
        box = [proposal]
        collectives.broadcast_object_list(box, src=0)
        decision = box[0]
        if "error" in decision:
            raise ValueError(f"strategy=auto could not choose a layout: {decision['error']}")
        return decision

    def _adopt(self, decision: dict[str, Any], announce: bool = True) -> None:
        """Configure the components for the decided layout (before any of them has set anything up)."""
        layout = Layout(**decision["layout"])
        self._requested_layout = ParallelLayout(
            data_parallel_size=layout.dp, tensor_parallel_size=layout.tp,
            pipeline_parallel_size=layout.pp, context_parallel_size=layout.cp, expert_parallel_size=layout.ep,
        )
        if layout.pp > 1:
            self.pipeline_parallel.config = replace(
                self.pipeline_parallel.config, schedule=layout.schedule, microbatches=layout.microbatches,
                stages_per_rank=layout.stages_per_rank,
            )
        self.data_parallel.config = replace(
            self.data_parallel.config, mode=layout.data_parallel_mode,
            shard_size=layout.shard_size if layout.data_parallel_mode == "hybrid_shard" else -1,
        )
        self.activation_checkpointing.patterns = normalize_patterns("auto" if layout.activation_checkpointing else None)
        if not announce:
            return
        if decision["batch_size"] != decision["per_rank"]:
            lightning_setattr(self.lightning_module, "batch_size", decision["batch_size"])
        rank_zero_info("lightning_parallel: " + "\n".join(decision["report"]))


def _hardware(hardware: HardwareProfile | Mapping[str, Any] | None) -> HardwareProfile:
    if isinstance(hardware, HardwareProfile):
        return hardware
    if isinstance(hardware, Mapping):
        return HardwareProfile.from_config(dict(hardware))
    raise TypeError(
        f"AutoParallelStrategy(hardware={hardware!r}): pass the hardware to plan for, a HardwareProfile or a mapping of "
        "one (Hydra: strategy=auto takes hardware=<name> from lightning_parallel/conf/hardware/)."
    )


def _pin(pin: Mapping[str, int] | None) -> dict[str, int]:
    pinned = dict(pin or {})
    for key, size in pinned.items():
        if key not in PINNABLE:
            raise ValueError(f"pin.{key}: only {', '.join(PINNABLE)} can be pinned (e.g. pin={{'tp': 2}}).")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"pin.{key}={size!r} must be a positive int.")
    return pinned


def _example_batch(trainer: Any) -> Any:
    """One training batch, as the fit loop will load it (a datamodule is set up for ``fit`` first)."""
    if trainer is None or trainer.state.fn != "fit":
        raise ValueError("strategy=auto plans for training: start with trainer.fit(...).")
    datamodule = trainer.datamodule
    if datamodule is not None:
        datamodule.setup("fit")
        loader = datamodule.train_dataloader()
    else:
        loader = trainer.fit_loop._data_source.dataloader()
    try:
        return next(iter(loader))
    except StopIteration:
        raise ValueError("strategy=auto needs one training batch to plan with, but the training dataloader is empty.") from None


def _batch_size(module: Any, batch: Any) -> int:
    """Samples per forward the dataloader gives now (the ``batch_size`` attribute if the module exposes one)."""
    if lightning_hasattr(module, "batch_size"):
        return int(lightning_getattr(module, "batch_size"))
    from lightning_parallel.plan.profile import _batch_rows

    return _batch_rows(batch)


# help() and IDEs: this strategy's own arguments and the options it passes on, not the ones it decides.
AutoParallelStrategy.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [p for p in inspect.signature(AutoParallelStrategy).parameters.values() if p.name not in CHOSEN_OPTIONS]
)
