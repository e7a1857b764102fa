"""Checkpoint files of the engine: sharded or full, written atomically, optionally in the background.

``save_format="sharded"`` (default): every rank writes its own shards through DCP, keyed by the module's
original parameter names (``checkpoint/sharded.py``). ``"full"``: whole tensors in one ``torch.save`` file
that loads into the plain module (``whole_state.py`` gathers them). Either is read by any layout.

Model tensors are loaded at the end of setup, into the module as it trains (its dtype, its shards; a
pipeline is cut only on the first batch, so it is still whole then). Sharded checkpoints are read in place into this
rank's tensors: each rank reads only the chunks its shards cover.
"""

from __future__ import annotations

import io
import logging
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from lightning_parallel.checkpoint.data_position import rescale_loader_positions
from lightning_parallel.checkpoint.files import (
    INFO_KEY,
    META_FILENAME,
    CheckpointFormat,
    atomic_torch_save,
    checkpoint_format,
    package_version,
    partial_path,
    prepare_partial,
    publish,
    remove_path,
)
from lightning_parallel.checkpoint.io import ParallelCheckpointIO
from lightning_parallel.checkpoint.sharded import (
    MODEL_KEY,
    check_model_fits,
    check_optimizer_fits,
    load_states,
    optimizer_key,
    read_meta,
    save_states,
    stored_keys,
    whole_to_states,
)
from lightning_parallel.checkpoint.state import (
    MISMATCH_HINT,
    all_pipeline_parts,
    describe_mismatch,
    local_named_optimizer_state,
)
from lightning_parallel.strategies.whole_state import unwrap_optimizer

log = logging.getLogger(__name__)

SAVE_FORMATS: tuple[str, ...] = get_args(CheckpointFormat)


@dataclass
class _PendingSave:
    """A save whose files are still being written in the background."""

    final: Path
    partial: Path
    future: Future
    meta: dict[str, Any] | None  # sharded: written by rank 0 once every rank's shards are on disk
    removals: list[Path] = field(default_factory=list)  # ModelCheckpoint cleanup, held until this save is complete


@dataclass(frozen=True)
class _ShardedOptimizerState:
    """Stands in ``checkpoint["optimizer_states"]`` for state still on disk (read in place on load)."""

    key: str


class CheckpointFilesMixin:
    """Lightning's checkpoint entry points for the engine (mixed in before ``WholeTensorCheckpointMixin``).

    Needs ``_save_format``, ``_async_save``, ``layout``, ``data_parallel``, ``pipeline_parallel``,
    ``parameters_are_dtensors`` and ``pipeline_runner`` from the engine.
    """

    _pending_save: _PendingSave | None = None
    _sharded_source: Path | None = None
    _loaded_from: Path | None = None
    _save_group: dist.ProcessGroup | None = None
    _writer: ThreadPoolExecutor | None = None
    _set_up = False  # setup has run since the last teardown: the module is as it trains
    _deferred_model_state: tuple[dict[str, Any], bool] | None = None
    _pending_rng_state: bytes | None = None  # a checkpoint's random streams, put back when training resumes

    # ------------------------------------------------------------------ what a checkpoint holds

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._save_format == "full":
            return super().lightning_module_state_dict()
        return self._local_model_state()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self._save_format == "full":
            return super().optimizer_state(optimizer)
        # Keyed by parameter names; DTensor shards stay shards (each rank writes its own).
        state = get_optimizer_state_dict(self.lightning_module, unwrap_optimizer(optimizer))
        if self.pipeline_parallel.staged:
            # param_groups is one entry that every rank writes: give each the whole model's names.
            merged = all_pipeline_parts({"state": {}, "param_groups": state["param_groups"]}, self.device_mesh["pp"].get_group())
            state = {"state": state["state"], "param_groups": merged["param_groups"]}
        return state

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Lightning passes fit(weights_only=...) only to the restore that runs before setup. The model's
        # tensors are loaded at the end of setup all the same (see load_model_state_dict).
        return False

    # ------------------------------------------------------------------ saving

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options; remove the argument.")
        periodic = self.data_parallel.periodic_sync
        if periodic is not None and (self._save_format != "sharded" or self._async_save):
            raise ValueError(
                f"Under sync={self.data_parallel.sync.method!r} replicas hold different weights between synchronizations, and each "
                f"replica's state is written beside the sharded checkpoint: use save_format='sharded' and async_save=False."
            )
        path = Path(self.broadcast(str(filepath)))  # every rank writes into rank 0's path
        self.finish_pending_save()
        checkpoint = {**checkpoint, INFO_KEY: self._checkpoint_info()}
        if self._save_format == "full":
            if self.is_global_zero:
                self._write_full(checkpoint, path)
            return
        if path.is_file():
            raise RuntimeError(
                f"Cannot write a sharded checkpoint (a directory) at {str(path)!r}: a checkpoint file is there. "
                "Choose another name, or pass save_format='full' to the strategy."
            )
        states, meta = whole_to_states(checkpoint)
        if self.is_global_zero:
            prepare_partial(path)
        self.barrier("lightning_parallel.prepare_checkpoint_dir")
        partial = partial_path(path)
        if self._in_background():
            future = save_states(states, partial, process_group=self._checkpoint_group(), asynchronous=True)
            self._pending_save = _PendingSave(path, partial, future, meta)
        else:
            save_states(states, partial)
            if periodic is not None:
                # The main state is replica 0's; each replica also keeps its own (model, optimizer, outer state).
                atomic_torch_save(self._replica_state(periodic), partial / replica_file_name(self.global_rank))
                self.barrier("lightning_parallel.replica_states")
            if self.is_global_zero:
                _publish_sharded(partial, path, meta)

    def _replica_state(self, periodic: Any) -> dict[str, Any]:
        return {
            "model": self.lightning_module.state_dict(),
            "optimizers": [unwrap_optimizer(o).state_dict() for o in self.optimizers],
            "sync": periodic.state_dict(),
            "data_parallel_size": self.layout.data_parallel_size,
        }

    def _restore_replica_state(self) -> None:
        """Under periodic sync, put this replica's own weights, optimizer and outer state back (if saved)."""
        periodic = self.data_parallel.periodic_sync
        source = self._sharded_source
        if periodic is None or source is None or not (source / replica_file_name(self.global_rank)).is_file():
            return
        state = torch.load(source / replica_file_name(self.global_rank), map_location=self.root_device, weights_only=False)
        if state["data_parallel_size"] != self.layout.data_parallel_size:
            raise ValueError(
                f"The checkpoint {str(source)!r} holds {state['data_parallel_size']} replicas' own states (sync="
                f"{self.data_parallel.sync.method!r}); resume it with data_parallel_size={state['data_parallel_size']}."
            )
        self.lightning_module.load_state_dict(state["model"])
        for optimizer, saved in zip(self.optimizers, state["optimizers"], strict=True):
            unwrap_optimizer(optimizer).load_state_dict(saved)
        periodic.load_state_dict(state["sync"])

    def _in_background(self) -> bool:
        """Write in the background only while fitting: a save outside a run completes before it returns."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return (
            self._async_save
            and trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING
        )

    def _write_full(self, checkpoint: dict[str, Any], path: Path) -> None:
        if not self._in_background():
            self.checkpoint_io.save_checkpoint(checkpoint, path)
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_parallel_ckpt")
        # Tensors are copied now; the file is written while training goes on.
        snapshot = _copy_tensors(checkpoint)
        future = self._writer.submit(atomic_torch_save, snapshot, path)
        self._pending_save = _PendingSave(path, partial_path(path), future, meta=None)

    def finish_pending_save(self) -> None:
        """Wait for a background save, make it visible under its final name, then run the cleanup it held back.

        Called before the next save, before a load and at teardown; every rank may call it on its own.
        """
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return
        pending.future.result()
        if self.is_global_zero:
            if pending.meta is not None:
                _publish_sharded(pending.partial, pending.final, pending.meta)
            for path in pending.removals:
                if path != pending.final:
                    remove_path(path)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        pending = self._pending_save
        if pending is not None:
            # The checkpoint being written is not complete yet: keep the older one until it is.
            pending.removals.append(Path(filepath))
        elif self.is_global_zero:
            remove_path(filepath)

    def on_train_start(self) -> None:
        # A checkpoint taken at the end of an epoch resumes with a new epoch, whose loader iterator (built
        # after this hook) draws from the random streams as it did in the run that saved it.
        self._restore_pending_rng_state()
        super().on_train_start()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx > 0:
            # Mid-epoch: the saving run's loader iterator existed already; the resumed one was just built
            # (drawing its seed): put the streams back right before the first step.
            self._restore_pending_rng_state()
        self._pending_rng_state = None
        pending = self._pending_save
        if pending is not None and pending.future.done():
            self.finish_pending_save()
        super().on_train_batch_start(batch, batch_idx)

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        """A gloo group for the background writer's collectives, apart from training's (created once)."""
        if self._save_group is None and dist.is_initialized():
            self._save_group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._save_group

    def _checkpoint_info(self) -> dict[str, Any]:
        layout = self.layout
        rng = _portable_rng_states()
        if dist.is_initialized():
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, rng)
        else:
            states = [rng]
        return {
            "format": self._save_format,
            "layout": {**layout.to_dict(), "data_parallel_mode": self.data_parallel.config.mode},
            "world_size": len(states),
            "versions": {"lightning_parallel": package_version(), "torch": str(torch.__version__)},
            "rng_states": states,
        }

    # ------------------------------------------------------------------ loading

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        self.finish_pending_save()
        self._sharded_source = None
        self._loaded_from = path
        if checkpoint_format(path) == "full":
            if isinstance(self.checkpoint_io, ParallelCheckpointIO):
                self.checkpoint_io.data_parallel_size = self.layout.data_parallel_size
            checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        else:
            checkpoint = read_meta(path, weights_only)
            count = len({key.split(".", 1)[0] for key in stored_keys(path) if key.startswith("optimizer_")})
            if count:
                checkpoint["optimizer_states"] = [_ShardedOptimizerState(optimizer_key(i)) for i in range(count)]
            self._sharded_source = path
        rescale_loader_positions(checkpoint, self.layout.data_parallel_size)
        self._restore_rng_states(checkpoint.get(INFO_KEY, {}))
        return checkpoint

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if not self._set_up:
            # Before setup the module has neither its training dtype (the precision plugin converts it in
            # setup: a float64 checkpoint loaded into Lightning's float32 module would be rounded) nor its
            # shards. The engine loads it at the end of setup (a pipeline is still whole then: it is cut on
            # the first batch).
            self._deferred_model_state = (checkpoint, strict)
            return
        self._load_model_state(checkpoint, strict)

    def load_deferred_model_state(self) -> None:
        """Called by the engine at the end of ``setup``: load a checkpoint's model state restored before it."""
        self._set_up = True
        if self._deferred_model_state is not None:
            (checkpoint, strict), self._deferred_model_state = self._deferred_model_state, None
            self._load_model_state(checkpoint, strict)

    def _load_model_state(self, checkpoint: dict[str, Any], strict: bool) -> None:
        expected = self._whole_model_shapes()
        source = self._sharded_source
        if source is None:
            found = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items() if isinstance(v, torch.Tensor)}
            message = describe_mismatch(expected, found, strict)
            if message:
                raise RuntimeError(f"The checkpoint {str(self._loaded_from)!r} does not fit this model: {message}. {MISMATCH_HINT}")
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        check_model_fits(source, expected, strict)
        # In place into this rank's tensors (whole, DTensor shards, or a stage's): DCP reads what they cover.
        load_states({MODEL_KEY: self._local_model_state()}, source, allow_partial=not strict)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise RuntimeError(
                f"The checkpoint holds the state of {len(states)} optimizer(s) but configure_optimizers returned "
                f"{len(self.optimizers)}: resume with the optimizers it was saved with."
            )
        if self._sharded_source is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, stored in zip(self.optimizers, states):
            optimizer = unwrap_optimizer(optimizer)
            target = get_optimizer_state_dict(self.lightning_module, optimizer)
            check_optimizer_fits(self._sharded_source, stored.key, target, type(optimizer).__name__)
            load_states({stored.key: target}, self._sharded_source)
            if self.pipeline_parallel.staged:
                names = {name for name, _ in self.lightning_module.named_parameters()}
                target = local_named_optimizer_state(target, names)
            set_optimizer_state_dict(self.lightning_module, optimizer, target)
        # Optimizers are restored after the model (and after setup): the last moment to put each replica's own back.
        self._restore_replica_state()

    def _restore_rng_states(self, info: dict[str, Any]) -> None:
        """Keep this rank's random streams from ``info`` until training resumes (``_restore_pending_rng_state``).

        Restoring them here, while the checkpoint is read, would let everything Lightning builds before the
        first step (the loaders, their iterators) draw from them: the resumed steps' dropout masks would
        then be those of later steps.
        """
        states = info.get("rng_states")
        if not states:
            return
        # The same layout continues each rank's random streams; another layout continues rank 0's everywhere.
        same_ranks = len(states) == self.world_size
        state = states[self.global_rank if same_ranks else 0]
        _restore_portable_rng_states(state)  # for validate/test/predict from a checkpoint
        self._pending_rng_state = state

    def _restore_pending_rng_state(self) -> None:
        if self._pending_rng_state is not None:
            _restore_portable_rng_states(self._pending_rng_state)

    # ------------------------------------------------------------------ this rank's tensors

    def _local_model_state(self) -> dict[str, Any]:
        """This rank's model tensors by original name: whole, DTensor shards, or its pipeline stages' only.

        They alias the parameters and buffers, so loading into them loads the module.
        """
        return dict(self.lightning_module.state_dict())

    def _whole_model_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.pipeline_parallel.staged:
            return dict(self.pipeline_runner.whole_shapes)
        # A DTensor's shape is the whole tensor's.
        return {name: tuple(value.shape) for name, value in self.lightning_module.state_dict().items()}

    def teardown(self) -> None:
        self._set_up = False
        self._deferred_model_state = None
        self._pending_rng_state = None
        failure = sys.exc_info()[1]
        try:
            self.finish_pending_save()
        except Exception as error:  # a run that failed must surface its own error, not the save's
            if failure is None:
                raise
            log.warning("lightning_parallel: the background checkpoint save did not complete: %s", error)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._save_group is not None:
            dist.destroy_process_group(self._save_group)
            self._save_group = None
        super().teardown()


def replica_file_name(rank: int) -> str:
    """The file in a sharded checkpoint holding one replica's own state under periodic sync."""
    return f"replica_{rank}.pt"


def _publish_sharded(partial: Path, final: Path, meta: dict[str, Any]) -> None:
    """Rank 0, once every rank's shards are written: the non-tensor part, then the rename that completes it."""
    torch.save(meta, partial / META_FILENAME)
    publish(partial, final)


def _portable_rng_states() -> bytes:
    """This process's RNG states (Lightning's collection) serialized so that every rank's can be gathered
    and read back with ``torch.load(weights_only=True)`` (numpy's key array stored as a tensor)."""
    states = _collect_rng_states(include_cuda=torch.cuda.is_available())
    if "numpy" in states:
        name, keys, *rest = states["numpy"]
        states["numpy"] = (name, torch.tensor(keys), *rest)
    buffer = io.BytesIO()
    torch.save(states, buffer)
    return buffer.getvalue()


def _restore_portable_rng_states(serialized: bytes) -> None:
    states = torch.load(io.BytesIO(serialized), weights_only=True)
    if "numpy" in states:
        name, keys, *rest = states["numpy"]
        states["numpy"] = (name, keys.numpy(), *rest)
    _set_rng_states(states)


def _copy_tensors(obj: Any) -> Any:
    """A deep copy of a checkpoint's tensors (the background writer must not see later training steps)."""
    return apply_to_collection(obj, torch.Tensor, lambda t: t.detach().clone())
