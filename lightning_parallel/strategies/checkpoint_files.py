"""Checkpoint files of the engine: sharded or full, written atomically, optionally in the background.

``save_format="sharded"`` (default): every rank writes its own shards through DCP, keyed by the module's
original parameter names (``checkpoint/sharded.py``). ``"full"``: whole tensors in one ``torch.save`` file
that loads into the plain module (``whole_state.py`` gathers them). Either is read by any layout.

What the files hold (model and optimizer state, out of and into this rank's tensors) is
``checkpoint_state.py``'s; sharded checkpoints are read in place into this rank's tensors: each rank
reads only the chunks its shards cover. Nothing is unpickled in full (which could run code from the file)
unless Lightning's ``weights_only=False`` says the checkpoint is trusted (``checkpoint/unpickling.py``).
"""

from __future__ import annotations

import io
import logging
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_parallel import collectives
from lightning_parallel.checkpoint.data_position import (
    check_same_global_batch,
    global_batch,
    rescale_loader_positions,
)
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
from lightning_parallel.checkpoint.io import RESUME_OPT_IN, ParallelCheckpointIO
from lightning_parallel.checkpoint.sharded import (
    optimizer_key,
    read_meta,
    save_states,
    stored_keys,
    whole_to_states,
)
from lightning_parallel.checkpoint.unpickling import load_file
from lightning_parallel.strategies.optimizer import unwrap_optimizer

if TYPE_CHECKING:
    from lightning_parallel.strategies.host import EngineHost

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


class CheckpointFiles:
    """The engine's checkpoint files: where they are written and read, atomically, optionally in the background.

    Args:
        engine: The strategy (its ranks, collectives, layout and components).
        save_format: ``"sharded"`` or ``"full"``.
        async_save: Write in the background while training goes on.
        timeout: How long the background writer's collectives may wait.
    """

    def __init__(
        self, engine: EngineHost, save_format: CheckpointFormat, async_save: bool, timeout: timedelta
    ) -> None:
        if save_format not in SAVE_FORMATS:
            raise ValueError(f"save_format={save_format!r} is unknown; choose one of {', '.join(SAVE_FORMATS)}.")
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be True or False, got {async_save!r}.")
        self.engine = engine
        self.save_format = save_format
        self.async_save = async_save
        self._timeout = timeout  # of the background writer's own process group
        self.sharded_source: Path | None = None  # a sharded checkpoint being loaded (read in place)
        self.loaded_from: Path | None = None
        self.trust_pickle = False  # the checkpoint being loaded was passed with weights_only=False
        self._pending_save: _PendingSave | None = None
        self._save_group: dist.ProcessGroup | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._pending_rng_state: bytes | None = None  # a checkpoint's random streams, put back when training resumes
        self._saved_global_batch: dict[str, int] | None = None  # how the loaded checkpoint's steps were made up

    # ------------------------------------------------------------------ saving

    def save(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` (every rank calls this; each writes its shards into rank 0's path)."""
        engine = self.engine
        if storage_options is not None:
            raise TypeError(f"{type(engine).__name__}.save_checkpoint does not take storage_options; remove the argument.")
        periodic = engine.data_parallel.periodic_sync
        if periodic is not None and (self.save_format != "sharded" or self.async_save):
            raise ValueError(
                f"Under sync={engine.data_parallel.sync.method!r} replicas hold different weights between synchronizations, "
                "and each replica's state is written beside the sharded checkpoint: use save_format='sharded' and async_save=False."
            )
        path = Path(engine.broadcast(str(filepath)))  # every rank writes into rank 0's path
        self.finish_pending_save()
        checkpoint = {**checkpoint, INFO_KEY: self._checkpoint_info()}
        if self.save_format == "full":
            if engine.is_global_zero:
                self._write_full(checkpoint, path)
            return
        if path.is_file():
            raise RuntimeError(
                f"Cannot write a sharded checkpoint (a directory) at {str(path)!r}: a checkpoint file is there. "
                "Choose another name, or pass save_format='full' to the strategy."
            )
        states, meta = whole_to_states(checkpoint)
        if engine.is_global_zero:
            prepare_partial(path)
        engine.barrier("lightning_parallel.prepare_checkpoint_dir")
        partial = partial_path(path)
        if self._in_background():
            future = save_states(states, partial, process_group=self._checkpoint_group(), asynchronous=True)
            self._pending_save = _PendingSave(path, partial, future, meta)
        else:
            save_states(states, partial)
            if periodic is not None:
                # The main state is replica 0's; each replica also keeps its own (model, optimizer, outer state).
                atomic_torch_save(self._replica_state(periodic), partial / replica_file_name(engine.global_rank))
                engine.barrier("lightning_parallel.replica_states")
            if engine.is_global_zero:
                _publish_sharded(partial, path, meta)

    def _replica_state(self, periodic: Any) -> dict[str, Any]:
        engine = self.engine
        return {
            "model": engine.lightning_module.state_dict(),
            "optimizers": [unwrap_optimizer(o).state_dict() for o in engine.optimizers],
            "sync": periodic.state_dict(),
            "data_parallel_size": engine.layout.data_parallel_size,
        }

    def restore_replica_state(self) -> None:
        """Under periodic sync, put this replica's own weights, optimizer and outer state back (if saved)."""
        engine = self.engine
        periodic = engine.data_parallel.periodic_sync
        source = self.sharded_source
        if periodic is None or source is None or not (source / replica_file_name(engine.global_rank)).is_file():
            return
        state = load_file(
            source / replica_file_name(engine.global_rank), trust_pickle=self.trust_pickle, opt_in=RESUME_OPT_IN,
            map_location=engine.root_device,
        )
        if state["data_parallel_size"] != engine.layout.data_parallel_size:
            raise ValueError(
                f"The checkpoint {str(source)!r} holds {state['data_parallel_size']} replicas' own states (sync="
                f"{engine.data_parallel.sync.method!r}); resume it with data_parallel_size={state['data_parallel_size']}."
            )
        engine.lightning_module.load_state_dict(state["model"])
        for optimizer, saved in zip(engine.optimizers, state["optimizers"], strict=True):
            unwrap_optimizer(optimizer).load_state_dict(saved)
        periodic.load_state_dict(state["sync"])

    def _in_background(self) -> bool:
        """Write in the background only while fitting: a save outside a run completes before it returns."""
        module = self.engine.lightning_module
        trainer = module.trainer if module is not None else None
        return (
            self.async_save
            and trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.status == TrainerStatus.RUNNING
        )

    def _write_full(self, checkpoint: dict[str, Any], path: Path) -> None:
        if not self._in_background():
            self.engine.checkpoint_io.save_checkpoint(checkpoint, path)
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
        if self.engine.is_global_zero:
            if pending.meta is not None:
                _publish_sharded(pending.partial, pending.final, pending.meta)
            for path in pending.removals:
                if path != pending.final:
                    remove_path(path)

    def remove(self, filepath: _PATH) -> None:
        """``ModelCheckpoint``'s cleanup of an older checkpoint (held back while a newer one is being written)."""
        pending = self._pending_save
        if pending is not None:
            # The checkpoint being written is not complete yet: keep the older one until it is.
            pending.removals.append(Path(filepath))
        elif self.engine.is_global_zero:
            remove_path(filepath)

    def on_train_start(self) -> None:
        saved, self._saved_global_batch = self._saved_global_batch, None
        current = self._global_batch()
        if current is not None:
            check_same_global_batch(saved, current)
        # A checkpoint taken at the end of an epoch resumes with a new epoch, whose loader iterator (built
        # after this hook) draws from the random streams as it did in the run that saved it.
        self._restore_pending_rng_state()

    def _global_batch(self) -> dict[str, int] | None:
        """This run's samples per optimizer step (``None`` outside fit, or for a loader without a batch size)."""
        module = self.engine.lightning_module
        trainer = module._trainer if module is not None else None
        loader = trainer.train_dataloader if trainer is not None else None
        per_replica = getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        if not isinstance(per_replica, int):
            return None
        return global_batch(per_replica, self.engine.layout.data_parallel_size, trainer.accumulate_grad_batches)

    def on_train_batch_start(self, batch_idx: int) -> None:
        if batch_idx > 0:
            # Mid-epoch: the saving run's loader iterator existed already; the resumed one was just built
            # (drawing its seed): put the streams back right before the first step.
            self._restore_pending_rng_state()
        self._pending_rng_state = None
        pending = self._pending_save
        if pending is not None and pending.future.done():
            self.finish_pending_save()

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        """A gloo group for the background writer's collectives, apart from training's (created once)."""
        if self._save_group is None and dist.is_initialized():
            self._save_group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._save_group

    def _checkpoint_info(self) -> dict[str, Any]:
        engine = self.engine
        rng = _portable_rng_states()
        if dist.is_initialized():
            states = collectives.all_gather_object(rng)
        else:
            states = [rng]
        return {
            "format": self.save_format,
            "layout": {**engine.layout.to_dict(), "data_parallel_mode": engine.data_parallel.config.mode},
            "world_size": len(states),
            "versions": {"lightning_parallel": package_version(), "torch": str(torch.__version__)},
            "rng_states": states,
            "global_batch": self._global_batch(),
        }

    # ------------------------------------------------------------------ loading

    def load(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint of any layout: a full file whole, a sharded one's metadata (tensors stay on disk).

        ``weights_only=False`` (Lightning's) trusts the checkpoint: it, and the sharded one's tensors and replica
        files read later, are unpickled in full. Otherwise objects that could run code are refused.
        """
        engine = self.engine
        path = Path(engine.broadcast(str(checkpoint_path)))
        self.finish_pending_save()
        self.sharded_source = None
        self.loaded_from = path
        self.trust_pickle = weights_only is False
        if checkpoint_format(path) == "full":
            if isinstance(engine.checkpoint_io, ParallelCheckpointIO):
                engine.checkpoint_io.data_parallel_size = engine.layout.data_parallel_size
            checkpoint = engine.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        else:
            checkpoint = read_meta(path, weights_only, RESUME_OPT_IN)
            count = len({key.split(".", 1)[0] for key in stored_keys(path) if key.startswith("optimizer_")})
            if count:
                checkpoint["optimizer_states"] = [_ShardedOptimizerState(optimizer_key(i)) for i in range(count)]
            self.sharded_source = path
        rescale_loader_positions(checkpoint, engine.layout.data_parallel_size)
        self._saved_global_batch = checkpoint.get(INFO_KEY, {}).get("global_batch")
        self._restore_rng_states(checkpoint.get(INFO_KEY, {}))
        return checkpoint

    def _restore_rng_states(self, info: dict[str, Any]) -> None:
        """Put this rank's random streams from ``info`` back, and again when training resumes.

        Restored only here, while the checkpoint is read, everything Lightning builds before the first step
        (the loaders, their iterators) would draw from them: the resumed steps' dropout masks would then be
        those of later steps (see :meth:`on_train_start`, :meth:`on_train_batch_start`).
        """
        states = info.get("rng_states")
        if not states:
            return
        # The same layout continues each rank's random streams; another layout continues rank 0's everywhere.
        same_ranks = len(states) == self.engine.world_size
        state = states[self.engine.global_rank if same_ranks else 0]
        _restore_portable_rng_states(state)  # for validate/test/predict from a checkpoint
        self._pending_rng_state = state

    def _restore_pending_rng_state(self) -> None:
        if self._pending_rng_state is not None:
            _restore_portable_rng_states(self._pending_rng_state)

    def teardown(self) -> None:
        """Complete a background save (a failed run surfaces its own error, not the save's) and free its resources."""
        self._pending_rng_state = None
        self._saved_global_batch = None
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
