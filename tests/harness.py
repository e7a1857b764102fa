"""Build and run small, float64 training jobs for the comparison tests.

A job is described by a JSON-able :class:`JobSpec`. The single-device reference runs in the test process;
multi-process jobs run ``python -m tests.worker`` so that Lightning's default launcher (which re-runs
the script per rank) is what gets tested. Rank 0 saves a :class:`Recorder`'s findings with ``torch.save``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import grad_norm
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import lightning_parallel
import lightning_parallel.collectives
from lightning_parallel.checkpoint.io import ParallelCheckpointIO
from lightning_parallel.measure.memory import state_bytes
from lightning_parallel.observe.monitor import ScalingMonitor
from lightning_parallel.parallelize.tensor.fused import original_order
from lightning_parallel.strategies.optimizer import unwrap_optimizer
from recipes.data.chars import CharCorpusDataModule
from recipes.data.images import SyntheticImagesDataModule
from recipes.models.convnet import ConvNetLightningModule
from recipes.models.gpt import GPTLightningModule
from tests.regressor import RegressionData, Regressor

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class JobSpec:
    # gpt | convnet | regressor (untraceable nn.Sequential) | regressor_loop (untraceable, no Sequential)
    # | hf_<family> (a transformers causal LM from a tiny config, see tests/hf_models.py, with transformers'
    # default attention, SDPA; hf_<family>:eager with attn_implementation="eager" instead)
    # (also hf_opt, hf_bert (masked LM), hf_vit and hf_resnet (image classifiers on synthetic images): OTHER_FAMILIES)
    # | demo_transformer (Lightning's demo nn.Transformer) | view_attention (hand-written Llama-style LM)
    # | rotary_attention (view_attention with rotary tables sliced by length and enable_gqa attention)
    # | llama_reference (issue 29's hand-written Llama: custom RMSNorm, SwiGLU module, view/reshape heads)
    # | hand_norm_attention (view_attention with Meta's hand-written RMSNorm: no reset_parameters())
    # | list_moe (view_attention with hand-written MoE blocks, experts an nn.ModuleList) | old_mixtral (the same
    # with transformers 4.x's Mixtral block)
    # | litgpt (Lightning's LitGPT model: fused GQA qkv, head counts on its Config dataclass; needs litgpt)
    model: str = "gpt"  # gpt_moe: the recipe GPT with a 4-expert top-2 Mixture-of-Experts layer in each block
    strategy: str = "single"  # single | data | tensor | pipeline | hybrid | auto (the planner chooses, for cpu_local)
    devices: int = 1
    batch_size: int = 4  # per data-parallel rank
    val_batch_size: int | None = None  # per data-parallel rank (default: batch_size)
    accumulate: int = 1
    steps: int = 5
    trainer_sync_batchnorm: bool = False
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    validate: bool = False
    predict: bool = False  # after validate: trainer.predict over the validation batches
    sanity_val_steps: int = 0  # Lightning's default is 2: validation batches before training starts
    fail_rank: int | None = None  # raise on this global rank ...
    fail_step: int = 2  # ... at this batch index
    nan_rank: int | None = None  # this global rank's loss turns NaN ...
    nan_step: int = 2  # ... at this batch index
    stall_rank: int | None = None  # this global rank sleeps in training_step (a hang, as the others see it) ...
    stall_step: int = 2  # ... at this batch index ...
    stall_seconds: float = 0.0  # ... this long (negative: forever, an event that never comes)
    gradient_clip_val: float | None = None
    # Save a checkpoint after fit, wipe the weights in memory, and validate from the checkpoint.
    checkpoint_round_trip: bool = False
    tie_weights: bool = True  # GPT: share the embedding with the output head
    n_layer: int = 2  # GPT blocks (and list_moe / old_mixtral blocks)
    n_embd: int = 16  # GPT width
    # Ranks other than 0 build different initial weights: the strategy must start all from rank 0's.
    perturb_other_ranks: bool = False
    precision: str = "64-true"  # Lightning's precision setting
    seed: int = 1234
    monitor: bool = False  # add a ScalingMonitor (its per-step figures land in the result's "scaling_steps")
    # Build the model under trainer.init_module(empty_init=...): None builds it plainly (Lightning converts its
    # dtype in setup), False eagerly in the precision's dtype, True with its parameters on the meta device.
    empty_init: bool | None = None
    # A file holding {"state_dict": ...} loaded into the whole module before training (a reference for weights_from).
    initial_weights: str | None = None
    # Count host reads of tensor values and torch.distributed collectives per training step after the first
    # (every rank's counts land in the result's "step_counts"; see HostSyncCounter).
    count_host_syncs: bool = False
    # GPT: log Lightning's grad_norm(self, 2) in on_before_optimizer_step (and lightning_parallel.grad_norm of its
    # inner model, inf norm); every rank's values land in the result's "grad_norms" / "grad_norms_inf".
    grad_norm_logging: bool = False
    # Train with Lightning's EMAWeightAveraging(decay=ema): the averaged parameters land in the result's "ema_params".
    ema: float | None = None
    val_check_interval: int | None = None  # validate every this many training batches during fit
    # After fit: lightning_parallel.save_adapters writes the peft model's adapters to <job dir>/adapters (lora_* models).
    save_adapters: bool = False
    # The library must refuse this job (tests.jobs_worker records the error as the job's result instead of failing
    # the launch; the test checks the message). A refusal that turns into training fails that test.
    expect_refusal: bool = False


class FailingStep(RuntimeError):
    """Raised on purpose by a test job, to check that every rank goes down."""


class RecordingGPT(GPTLightningModule):
    """The recipe GPT plus what the tests observe: a synced log, and a rank that fails on purpose."""

    def __init__(
        self,
        fail_rank: int | None = None,
        fail_step: int = 2,
        nan_rank: int | None = None,
        nan_step: int = 2,
        stall_rank: int | None = None,
        stall_step: int = 2,
        stall_seconds: float = 0.0,
        log_grad_norms: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.log_grad_norms = log_grad_norms
        self.logged_grad_norms: list[dict[str, float]] = []
        self.logged_grad_norms_inf: list[dict[str, float]] = []
        self.fail_rank, self.fail_step = fail_rank, fail_step
        self.nan_rank, self.nan_step = nan_rank, nan_step
        self.stall_rank, self.stall_step, self.stall_seconds = stall_rank, stall_step, stall_seconds

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_rank == self.global_rank and batch_idx == self.fail_step:
            raise FailingStep(f"rank {self.global_rank} fails on purpose at batch {batch_idx}")
        if self.stall_rank == self.global_rank and batch_idx == self.stall_step:
            if self.stall_seconds < 0:  # forever: waits for an event that never comes (the job must end it)
                threading.Event().wait()
            time.sleep(self.stall_seconds)
        loss = super().training_step(batch, batch_idx)
        if self.nan_rank == self.global_rank and batch_idx == self.nan_step:
            loss = loss * float("nan")
        self.log("train/loss_synced", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, _ = batch
        return self(idx).softmax(dim=-1)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.log_grad_norms:
            # As Lightning's docs show it (imported before the run): under the strategy, whole-model norms.
            norms = grad_norm(self, norm_type=2)
            self.log_dict(norms)
            self.logged_grad_norms.append({k: float(v) for k, v in norms.items()})
            inf = lightning_parallel.grad_norm(self.model, "inf")
            self.logged_grad_norms_inf.append({k: float(v) for k, v in inf.items()})


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor shard (a collective: every rank must call it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def single_device_order(datamodule: L.LightningDataModule, seed: int) -> None:
    """Feed a single-device run the training order a distributed run sees.

    Under any distributed strategy Lightning always gives the training set a shuffling DistributedSampler
    seeded with the global seed. Replica r takes every W-th index of one permutation, so global
    micro-batch k is exactly block k of that permutation: a one-replica DistributedSampler with the same
    seed reproduces it on a single device.
    """
    make_loader = datamodule.train_dataloader

    def train_dataloader() -> DataLoader:
        loader = make_loader()
        sampler = DistributedSampler(loader.dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
        return StatefulDataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last)

    datamodule.train_dataloader = train_dataloader


_REDUCE_SCATTERS = [0]


def _count_reduce_scatters() -> None:
    """Count FSDP2's gradient reduce-scatters in this process (test instrumentation: FSDP2 has no comm hook)."""
    original = getattr(torch.distributed, "reduce_scatter_single", None)
    if original is None or getattr(original, "_counted", False):
        return

    def counted(*args: Any, **kwargs: Any) -> Any:
        _REDUCE_SCATTERS[0] += 1
        return original(*args, **kwargs)

    counted._counted = True
    torch.distributed.reduce_scatter_single = counted


class HostSyncCounter:
    """Counts, in this process, what would make a GPU step wait or talk: reads of a tensor's value on the host
    (``item``, ``tolist``, ``bool``/``int``/``float``/``index`` of a tensor) and ``torch.distributed`` collectives
    called by name (the schedules' point-to-point sends and receives are not collectives and are not counted;
    the calls torch makes inside ``broadcast_object_list`` count as that one call).

    Test instrumentation: the methods are patched once per process and count only while :attr:`active`.
    """

    READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    #: Callers whose reads are of tensors kept on the host on a GPU too, so no stall there: torch's optimizers'
    #: ``step`` counters (unless capturable) and a DeviceMesh's table of ranks.
    HOST_RESIDENT = ("torch.optim", "torch.distributed.device_mesh")
    COLLECTIVES = (
        "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
        "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "barrier", "monitored_barrier",
        "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    )

    def __init__(self) -> None:
        self.active = False
        self.counts: dict[str, int] = {}
        self._depth = 0  # calls into the library's collectives module running (only the outermost counts)
        for name in self.READS:
            self._patch(torch.Tensor, name, skip_callers=self.HOST_RESIDENT)
        for name in self.COLLECTIVES:
            self._patch(torch.distributed, name)
        # The library's own collectives (all of them go through this one module), as "library.<name>"; one that
        # calls another there counts once. The functional ones are the layers' own exchanges of activations
        # (context parallelism's keys and values, expert dispatch, ...), as "activation.<name>": like tensor
        # parallelism's, there are as many as layers by design.
        for name in lightning_parallel.collectives.__all__:
            if name != "group_device":
                kind = "activation" if name.startswith(("functional_", "differentiable_")) else "library"
                self._patch(lightning_parallel.collectives, name, key=f"{kind}.{name}", outermost=True)

    def _patch(
        self, owner: Any, name: str, key: str | None = None, outermost: bool = False, skip_callers: tuple[str, ...] = ()
    ) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return
        counter, key = self, key or name

        def counted(*args: Any, **kwargs: Any) -> Any:
            skipped = skip_callers and sys._getframe(1).f_globals.get("__name__", "").startswith(skip_callers)
            if counter.active and not (outermost and counter._depth) and not skipped:
                counter.counts[key] = counter.counts.get(key, 0) + 1
            if not outermost:
                return original(*args, **kwargs)
            counter._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._depth -= 1

        setattr(owner, name, counted)

    def start(self) -> None:
        self.counts, self.active = {}, True

    def stop(self) -> dict[str, int]:
        self.active = False
        return dict(self.counts)


_SYNC_COUNTER: list[HostSyncCounter] = []


def host_sync_counter() -> HostSyncCounter:
    """This process's counter (jobs sharing a launch share it: the methods are patched once)."""
    if not _SYNC_COUNTER:
        _SYNC_COUNTER.append(HostSyncCounter())
    return _SYNC_COUNTER[0]


class Recorder(Callback):
    """Collects losses, gradients, parameters and communication counts during one job."""

    def __init__(self, save_path: Path | None = None, count_host_syncs: bool = False) -> None:
        self.save_path = save_path
        self.sync_counter = host_sync_counter() if count_host_syncs else None
        self.step_counts: list[dict[str, int]] = []  # per training step after the first (count_host_syncs)
        self.states: list[dict[str, torch.Tensor]] = []  # after each optimizer step (params + buffers)
        self.grads: list[dict[str, torch.Tensor]] = []  # just before each optimizer step
        self.batch_losses: list[torch.Tensor] = []  # what training_step returned, per (micro-)batch
        self.synced_logs: list[float] = []
        self.val_losses: list[float] = []  # each validation's val/loss during fit
        self.first_batch_checksum: float | None = None
        self._reduce_scatters_at_start = 0
        self.state_bytes: dict[str, int] = {}
        self.result: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.first_batch_checksum is None:
            inputs = batch[0].to(torch.float64)
            # Position-weighted, so that a reordered batch does not pass for the same one.
            self.first_batch_checksum = float((inputs.flatten() * torch.arange(1, inputs.numel() + 1)).sum())
        if self.sync_counter is not None and batch_idx >= 1:  # the first step builds the pipeline
            self.sync_counter.start()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking and "val/loss" in trainer.callback_metrics:
            self.val_losses.append(float(trainer.callback_metrics["val/loss"]))

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _count_reduce_scatters()
        self._reduce_scatters_at_start = _REDUCE_SCATTERS[0]

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        # Before the step: gradients exist, and the optimizer state of the previous steps.
        counting = self.sync_counter is not None and self.sync_counter.active
        if counting:  # what the recorder itself reads and gathers is not the step's
            self.sync_counter.active = False
        self.state_bytes = state_bytes(pl_module, [unwrap_optimizer(o) for o in trainer.optimizers]).as_dict()
        with _not_counted(trainer):  # the monitor measures the training's collectives, not these gathers
            # Fused projections split by blocks train with their rows reordered: compare in the module's order.
            grads = {
                n: original_order(pl_module, n, full(p.grad)).detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None
            }
            self.grads.append(_whole_across_stages(trainer, grads))
        if counting:
            self.sync_counter.active = True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.sync_counter is not None and self.sync_counter.active:
            self.step_counts.append(self.sync_counter.stop())
        # Lightning hands back the loss divided by the accumulation factor.
        self.batch_losses.append(outputs["loss"].detach() * trainer.accumulate_grad_batches)
        if "train/loss_synced" in trainer.callback_metrics:
            self.synced_logs.append(float(trainer.callback_metrics["train/loss_synced"]))
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            state = {k: full(v).detach().clone() for k, v in pl_module.state_dict().items()}
            self.states.append(_whole_across_stages(trainer, state))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        local = torch.stack(self.batch_losses)
        # Mean over replicas of each micro-batch loss = the loss of the global micro-batch.
        gathered = trainer.strategy.all_gather(local) if trainer.world_size > 1 else local.unsqueeze(0)
        per_micro = gathered.mean(dim=0)
        comm = getattr(trainer.strategy, "comm_stats", None)
        checksums = [self.first_batch_checksum]
        if torch.distributed.is_initialized():
            checksums = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(checksums, self.first_batch_checksum)
        step_counts = [self.step_counts]
        if self.sync_counter is not None and torch.distributed.is_initialized():
            step_counts = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(step_counts, self.step_counts)
        self.result = {
            "step_losses": per_micro.reshape(-1, trainer.accumulate_grad_batches).mean(dim=1),
            "states": self.states,
            "grads": self.grads,
            "synced_logs": self.synced_logs,
            "replica_spread": replica_spread(_by_rank(_shard_slots(pl_module)) or [{}]),
            "comm": comm.as_dict() if comm is not None else None,
            "param_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters()),
            "local_numel": {n: local_shard(p).numel() for n, p in pl_module.named_parameters()},
            # Every rank's (by global rank): memory shares are the largest rank's, not rank 0's.
            "local_numel_by_rank": _by_rank({n: local_shard(p).numel() for n, p in pl_module.named_parameters()}),
            "first_batch_checksums": checksums,
            "step_counts": step_counts,  # by global rank, per step after the first: {what: calls} (count_host_syncs)
            "reduce_scatters": _REDUCE_SCATTERS[0] - self._reduce_scatters_at_start,
            "dtensor_names": [n for n, p in pl_module.named_parameters() if isinstance(p, DTensor)],
            "world_size": trainer.world_size,
            "layout": trainer.strategy.planned_layout().describe() if hasattr(trainer.strategy, "planned_layout") else None,
            "pipeline_training_rows": getattr(getattr(trainer.strategy, "pipeline_runner", None), "training_rows", None),
            "compiled_blocks": list(getattr(getattr(trainer.strategy, "compile", None), "compiled", [])),
            "state_bytes": self.state_bytes,
            "scaling_steps": [asdict(step) for step in _monitor(trainer).steps] if _monitor(trainer) else None,
            "grad_norms": _by_rank(getattr(pl_module, "logged_grad_norms", None)),  # by global rank, per step
            "grad_norms_inf": _by_rank(getattr(pl_module, "logged_grad_norms_inf", None)),
            "ema_params": _averaged_parameters(trainer),
            "val_losses": self.val_losses,
        }
        # Saved from inside the rank-0 process: with start_method="spawn" that is not the launching process.
        if self.save_path is not None and trainer.is_global_zero:
            torch.save(self.result, self.save_path)


def _shard_slots(module: torch.nn.Module) -> dict[tuple[Any, ...], torch.Tensor]:
    """This rank's local tensor of every parameter, keyed by which part of it the rank holds: its name and, for a
    DTensor, its coordinate along every mesh dimension that splits it (ranks differing only along replicated
    dimensions hold copies). A plain tensor's key is its name: every rank holding it holds all of it."""
    slots = {}
    for name, param in module.named_parameters():
        where: tuple[Any, ...] = ()
        if isinstance(param, DTensor):
            coordinate = param.device_mesh.get_coordinate() or []
            names = param.device_mesh.mesh_dim_names or tuple(range(param.device_mesh.ndim))
            where = tuple((names[i], coordinate[i]) for i, placement in enumerate(param.placements) if not placement.is_replicate())
        slots[(name, where)] = local_shard(param).detach().to("cpu", torch.float64).clone()
    return slots


def replica_spread(slots_by_rank: list[dict[tuple[Any, ...], torch.Tensor]]) -> float:
    """The largest difference between two ranks' copies of the same part of a parameter (every rank's
    :func:`_shard_slots`, by global rank): the local shards themselves, not ``full_tensor()``, whose all-gather
    hands every rank the same values and so is always 0 under tensor parallelism and FSDP. A shape mismatch
    between copies is infinite."""
    first: dict[tuple[Any, ...], torch.Tensor] = {}
    spread = 0.0
    for slots in slots_by_rank:
        for key, tensor in slots.items():
            if key not in first:
                first[key] = tensor
            elif tensor.shape != first[key].shape:
                return float("inf")
            elif tensor.numel():
                differs = (tensor - first[key]).abs()
                # NaN in one copy only is a difference (max() would pass over it); NaN in both is the same value.
                differs = torch.where(torch.isnan(tensor) & torch.isnan(first[key]), 0.0, differs.nan_to_num(nan=float("inf")))
                spread = max(spread, float(differs.max()))
    return spread


def _by_rank(value: Any) -> list[Any] | None:
    """``value`` of every rank, by global rank (``None`` where no rank has one)."""
    if not value:
        return None
    if not torch.distributed.is_initialized():
        return [value]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def _averaged_parameters(trainer: L.Trainer) -> dict[str, torch.Tensor] | None:
    """The whole averaged parameters of the job's EMA callback (before it copies them into the module)."""
    callback = next((c for c in trainer.callbacks if isinstance(c, EMAWeightAveraging)), None)
    if callback is None or callback._average_model is None:
        return None
    named = {n: full(p).detach().clone() for n, p in callback._average_model.module.named_parameters()}
    return _whole_across_stages(trainer, named)


def _divides_expert_lists(trainer: L.Trainer) -> bool:
    return bool(getattr(getattr(trainer.strategy, "expert_parallel", None), "expert_lists", None))


def _monitor(trainer: L.Trainer) -> ScalingMonitor | None:
    return next((c for c in trainer.callbacks if isinstance(c, ScalingMonitor)), None)


def _not_counted(trainer: L.Trainer) -> Any:
    monitor = _monitor(trainer)
    return monitor.not_counted() if monitor is not None else contextlib.nullcontext()


def _whole_across_stages(trainer: L.Trainer, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Under pipeline parallelism each rank holds its stages' tensors: merge them onto the stage-0 rank (and
    nn.ModuleList experts divided by expert parallelism: each rank holds its own experts' tensors, by global name)."""
    if _divides_expert_lists(trainer):
        from lightning_parallel.checkpoint.state import all_pipeline_parts

        named = all_pipeline_parts({k: v.cpu() for k, v in named.items()}, torch.distributed.group.WORLD)
    runner = getattr(trainer.strategy, "pipeline_runner", None)
    if runner is None:
        return named
    from lightning_parallel.checkpoint import gather_pipeline_parts

    return gather_pipeline_parts({k: v.cpu() for k, v in named.items()}, runner.pp_group)


def make_data(spec: JobSpec) -> L.LightningDataModule:
    """The job's data module (no shuffling)."""
    if spec.model == "gpt_packed":  # the recipe's data with pack_documents=true: documents between blank lines
        return CharCorpusDataModule(block_size=16, batch_size=spec.batch_size, val_batch_size=spec.val_batch_size,
                                    max_chars=20_000, shuffle=False, pack_documents=True)
    if spec.model.startswith("hf_"):
        from tests.hf_models import is_image_family

        if is_image_family(spec.model.removeprefix("hf_").partition(":")[0]):  # hf_vit, hf_resnet
            return SyntheticImagesDataModule(num_train=256, num_val=64, image_size=8, batch_size=spec.batch_size, shuffle=False)
    if spec.model in ("gpt", "gpt_moe", "demo_transformer", "view_attention", "rotary_attention", "hand_norm_attention", "litgpt", "llama_reference", "router_loss_mixtral", "reduced_kv_attention", "list_moe", "old_mixtral", "packed_documents", "padded_window", "packed_long_first") or spec.model.startswith(("hf_", "lora_")):
        return CharCorpusDataModule(
            block_size=8, batch_size=spec.batch_size, val_batch_size=spec.val_batch_size, max_chars=20_000, shuffle=False
        )
    if spec.model in ("regressor", "regressor_loop"):
        return RegressionData(batch_size=spec.batch_size)
    if spec.model == "convnet":
        return SyntheticImagesDataModule(num_train=256, num_val=64, image_size=8, batch_size=spec.batch_size, shuffle=False)
    raise ValueError(f"unknown model {spec.model!r}")


def make_model(spec: JobSpec) -> L.LightningModule:
    """The job's LightningModule (as built before Lightning converts it to the job's precision)."""
    if spec.model in ("gpt", "gpt_moe", "gpt_packed"):
        return RecordingGPT(
            vocab_size=128, block_size=16 if spec.model == "gpt_packed" else 8, n_layer=spec.n_layer, n_head=2, n_embd=spec.n_embd, dropout=0.0, lr=1e-2, tie_weights=spec.tie_weights,
            n_experts=4 if spec.model == "gpt_moe" else 0,
            fail_rank=spec.fail_rank, fail_step=spec.fail_step, nan_rank=spec.nan_rank, nan_step=spec.nan_step,
            stall_rank=spec.stall_rank, stall_step=spec.stall_step, stall_seconds=spec.stall_seconds,
            log_grad_norms=spec.grad_norm_logging,
        )
    if spec.model in ("regressor", "regressor_loop"):
        return Regressor(sequential=spec.model == "regressor")
    if spec.model == "convnet":
        return ConvNetLightningModule(width=4, lr=0.1)
    if spec.model == "demo_transformer":
        from tests.hf_models import DemoTransformer

        return DemoTransformer()
    if spec.model == "view_attention":
        from tests.hf_models import ViewAttentionLM

        return ViewAttentionLM()
    if spec.model == "rotary_attention":
        from tests.hf_models import RotaryLM

        return RotaryLM()
    if spec.model == "llama_reference":
        from tests.hf_models import ReferenceLlamaLM

        return ReferenceLlamaLM()
    if spec.model == "reduced_kv_attention":
        from tests.hf_models import ReducedKVLM

        return ReducedKVLM()
    if spec.model == "hand_norm_attention":
        from tests.hf_models import HandNormLM

        return HandNormLM()
    if spec.model in ("list_moe", "old_mixtral"):
        from tests.hf_models import ListMoELM

        return ListMoELM(old_mixtral=spec.model == "old_mixtral", n_layers=spec.n_layer)
    if spec.model == "router_loss_mixtral":
        from tests.hf_models import RouterLossLM

        return RouterLossLM()
    if spec.model in ("packed_documents", "padded_window", "packed_long_first"):  # documents / padding (cp masks)
        from tests.hf_models import PackedDocumentsLM

        return PackedDocumentsLM(padding=spec.model == "padded_window", long_first=spec.model == "packed_long_first")
    if spec.model == "litgpt":
        from tests.hf_models import LitGPTLM

        return LitGPTLM()
    if spec.model.startswith("lora_"):  # a transformers LM wrapped by peft's get_peft_model (adapters train)
        from tests.lora_models import LoraCausalLM

        return LoraCausalLM(spec.model.removeprefix("lora_"))
    if spec.model.startswith("hf_"):
        from tests.hf_models import make_hf_model

        family, _, attention = spec.model.removeprefix("hf_").partition(":")
        return make_hf_model(family, attention=attention or "sdpa")
    raise ValueError(f"unknown model {spec.model!r}")


def local_hardware() -> Any:
    """The hardware profile the recipes plan for on this machine (the package's conf/hardware/cpu_local.yaml)."""
    import yaml

    from lightning_parallel.conf import CONFIG_DIR
    from lightning_parallel.plan.hardware import HardwareProfile

    return HardwareProfile.from_config(yaml.safe_load((CONFIG_DIR / "hardware" / "cpu_local.yaml").read_text()))


def job_dir(save_path: Path | None) -> Path:
    """Where a job writes its files: beside its result, or a fresh temporary directory (never the working
    directory: an in-process reference job would leave its files in the repository)."""
    return save_path.parent if save_path is not None else Path(tempfile.mkdtemp(prefix="lightning-parallel-job-"))


def build(spec: JobSpec, save_path: Path | None = None) -> tuple[L.LightningModule, L.LightningDataModule, L.Trainer, Recorder]:
    """Module, data, and Trainer for ``spec`` (float64, no shuffling, no dropout)."""
    L.seed_everything(spec.seed, workers=True)
    data = make_data(spec)
    model = make_model(spec) if spec.empty_init is None else None
    if spec.perturb_other_ranks and model is not None and int(os.environ.get("LOCAL_RANK", "0")) > 0:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.1)
    if spec.strategy == "single":
        strategy: Any = "auto"
        single_device_order(data, spec.seed)
    elif spec.strategy == "lightning_ddp":  # Lightning's own, the reference the library's costs are read against
        strategy = DDPStrategy(timeout=timedelta(seconds=60))
    elif spec.strategy == "data":
        strategy = lightning_parallel.DataParallelStrategy(**{"timeout": 60, **spec.strategy_kwargs})
    elif spec.strategy == "tensor":
        strategy = lightning_parallel.TensorParallelStrategy(**{"timeout": 60, **spec.strategy_kwargs})
    elif spec.strategy == "pipeline":
        strategy = lightning_parallel.PipelineParallelStrategy(**{"timeout": 60, **spec.strategy_kwargs})
    elif spec.strategy == "hybrid":
        strategy = lightning_parallel.HybridParallelStrategy(**{"timeout": 60, **spec.strategy_kwargs})
    elif spec.strategy == "auto":
        strategy = lightning_parallel.AutoParallelStrategy(**{"timeout": 60, "hardware": local_hardware(), **spec.strategy_kwargs})
    else:
        raise ValueError(f"unknown strategy {spec.strategy!r}")
    recorder = Recorder(save_path, count_host_syncs=spec.count_host_syncs)
    callbacks: list[Callback] = [recorder]
    if spec.monitor:  # first, so that its step ends before the recorder gathers the state
        callbacks.insert(0, ScalingMonitor(warmup_steps=0, output_dir=job_dir(save_path) / "scaling"))
    if spec.ema is not None:  # after the recorder: it reads the average before the callback's end copies it
        callbacks.append(EMAWeightAveraging(decay=spec.ema))
    # Lightning's own strategy with our checkpoint I/O: atomic files, and it reads sharded checkpoints.
    plugins: list[Any] = [ParallelCheckpointIO()] if spec.strategy == "single" else []
    precision: str | None = spec.precision
    if precision == "16-mixed":
        # Lightning refuses the flag on a CPU; its plugin runs there (CPU autocast to float16, torch's CPU scaler).
        plugins.append(MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu")))
        precision = None
    trainer = L.Trainer(
        plugins=plugins or None,
        accelerator="cpu",
        devices=spec.devices,
        strategy=strategy,
        precision=precision,
        max_steps=spec.steps,
        accumulate_grad_batches=spec.accumulate,
        sync_batchnorm=spec.trainer_sync_batchnorm,
        gradient_clip_val=spec.gradient_clip_val,
        limit_val_batches=4,
        limit_predict_batches=3,
        num_sanity_val_steps=spec.sanity_val_steps,
        val_check_interval=spec.val_check_interval,
        check_val_every_n_epoch=None,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if model is None:
        with trainer.init_module(empty_init=spec.empty_init):
            if spec.perturb_other_ranks and int(os.environ.get("LOCAL_RANK", "0")) > 0:
                torch.manual_seed(spec.seed + 1)  # other ranks draw other initial weights, unless rank 0's are used
            model = make_model(spec)
    if spec.initial_weights is not None:
        model.load_state_dict(torch.load(spec.initial_weights, weights_only=True)["state_dict"])
    return model, data, trainer, recorder


def run_job(spec: JobSpec, save_path: Path | None = None) -> dict[str, Any]:
    """Train (and optionally validate) ``spec``; returns rank 0's findings and saves them to ``save_path``."""
    model, data, trainer, recorder = build(spec, save_path)
    trainer.fit(model, datamodule=data)
    result = dict(recorder.result)
    if spec.save_adapters:
        lightning_parallel.save_adapters(trainer, job_dir(save_path) / "adapters")
    ckpt_path = None
    if spec.checkpoint_round_trip:
        ckpt_path = job_dir(save_path) / "final.ckpt"
        trainer.save_checkpoint(ckpt_path)
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
    if spec.validate:
        validation = trainer.validate(model, datamodule=data, ckpt_path=ckpt_path, verbose=False)[0]
        result["validation"] = validation
        if spec.predict:
            result["predictions"] = torch.cat(trainer.predict(model, dataloaders=data.val_dataloader()))
        if save_path is not None and trainer.is_global_zero:
            # Under "spawn" the recorder wrote from a child process: add to what it saved.
            saved = torch.load(save_path, weights_only=False)
            extra = {k: result[k] for k in ("validation", "predictions") if k in result}
            torch.save({**saved, **extra}, save_path)
    return result


def run_distributed(spec: JobSpec, tmp_path: Path, timeout: float = 240, torchrun: bool = False) -> dict[str, Any]:
    """Run ``spec`` as ``python -m tests.worker`` (or under torchrun); returns rank 0's result."""
    proc = launch_worker(spec, tmp_path, timeout, torchrun)
    if proc.returncode != 0:
        raise AssertionError(f"job failed with exit code {proc.returncode}:\n{failure_report(proc)}")
    return torch.load(tmp_path / "result.pt", weights_only=False)


def run_distributed_jobs(specs: dict[str, JobSpec], tmp_path: Path, timeout: float = 400) -> dict[str, dict[str, Any]]:
    """Run jobs with the same number of ranks one after another in one torchrun launch; rank 0's results by name.

    Each job gets ``tmp_path/<name>/`` (its result, and its checkpoint for a round trip).
    """
    (devices,) = {spec.devices for spec in specs.values()}
    plan = []
    for name, spec in specs.items():
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
        plan.append({"spec": asdict(spec), "result": str(tmp_path / name / "result.pt")})
    plan_file = tmp_path / "jobs.json"
    plan_file.write_text(json.dumps(plan))
    proc = launch_module(["tests.jobs_worker", str(plan_file)], timeout, nproc=devices)
    if proc.returncode != 0:
        raise AssertionError(f"jobs failed with exit code {proc.returncode}:\n{failure_report(proc)}")
    return {name: torch.load(tmp_path / name / "result.pt", weights_only=False) for name in specs}


def launch_worker(spec: JobSpec, tmp_path: Path, timeout: float, torchrun: bool = False) -> subprocess.CompletedProcess:
    """Run the worker in its own session; on timeout kill the whole session (every rank) and fail.

    By default Lightning's launcher starts the extra ranks; with ``torchrun=True`` torchrun starts all of
    them and Lightning must detect it through its cluster environment.
    """
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(asdict(spec)))
    arguments = ["tests.worker", str(spec_file), str(tmp_path / "result.pt")]
    return launch_module(arguments, timeout, nproc=spec.devices if torchrun else None)


#: Lines of a failed launch's stderr worth showing even when the tail is full of the other ranks' teardown.
_FIRST_FAILURE = re.compile(r"terminate called|Fatal Python error|Segmentation fault|Abort|what\(\)|Error:|Exception:")


def failure_report(proc: subprocess.CompletedProcess) -> str:
    """A failed launch's output: the first lines that say why any rank failed (a rank killed by a signal leaves
    them far above the tail, under the survivors' tracebacks), then the tails of stdout and stderr."""
    first = []
    for line in proc.stderr.splitlines():
        if _FIRST_FAILURE.search(line) and line not in first:
            first.append(line)
        if len(first) == 20:
            break
    return "\n".join(["first error lines:", *first, "stdout tail:", proc.stdout[-4000:], "stderr tail:", proc.stderr[-8000:]])


#: What training in this process writes into ``os.environ`` for the ranks it launches (Lightning's launcher and
#: ``seed_everything``): a job launched later must not read it as its own launch or seed.
_LEFT_BY_TRAINING = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")
#: ``OMP_NUM_THREADS`` as this process started (read when the tests import this module, before any test trains).
#: Lightning's launcher, run by a Trainer in this process (a one-device ``DataParallelStrategy``), sets it to
#: cores // ranks (2 on two cores) when absent, and torchrun gives each rank one thread only when it is absent: the
#: launches after such a test ran each rank on two threads, and MKL's QR (``nn.init.orthogonal_``, RWKV's init)
#: rounds differently on two threads than on one, so a comparison's two sides started from different weights.
_STARTING_THREADS = os.environ.get("OMP_NUM_THREADS")


def launch_environment(**pinned: str) -> dict[str, str]:
    """The environment of a job launched from this process: this process's own, less what training in it left there
    (:data:`_LEFT_BY_TRAINING`, and ``OMP_NUM_THREADS`` back to its starting value), plus ``pinned``."""
    env = {name: value for name, value in os.environ.items() if name not in _LEFT_BY_TRAINING and name != "OMP_NUM_THREADS"}
    if _STARTING_THREADS is not None:
        env["OMP_NUM_THREADS"] = _STARTING_THREADS
    return {**env, **pinned}


def launch_module(arguments: list[str], timeout: float, nproc: int | None = None) -> subprocess.CompletedProcess:
    """``python -m <arguments>`` (under torchrun with ``nproc`` processes) in its own session, killed whole on timeout."""
    # One inductor compile worker per rank: eight ranks on two cores each forking a compile pool only adds processes.
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", **launch_environment(), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", *arguments]
    if nproc is not None:
        command[1:2] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m"]
    proc = subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"job hung for more than {timeout}s and was killed:\n{stderr[-8000:]}") from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains ``text`` (to find leftover ranks)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(entry.name))
    return pids
