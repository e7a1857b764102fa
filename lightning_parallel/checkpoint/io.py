"""``ParallelCheckpointIO``: Lightning's checkpoint I/O plugin, made atomic and able to read sharded checkpoints.

Our strategies use it by default. Give it to Lightning's own strategies (single device, DDP) to resume
from a checkpoint that a sharded layout wrote::

    Trainer(plugins=[ParallelCheckpointIO()]).fit(model, ckpt_path="outputs/run/checkpoints/last.ckpt")

Reading never unpickles in full (which runs any code the file names) unless Lightning's ``weights_only=False``
says the checkpoint is trusted: objects beyond tensors, plain containers and the few types our own checkpoints
hold are refused (``checkpoint/unpickling.py``). ``weights_only=None`` counts as ``True``, for remote paths too.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from lightning_parallel.checkpoint.data_position import rescale_loader_positions
from lightning_parallel.checkpoint.files import (
    INFO_KEY,
    atomic_torch_save,
    checkpoint_format,
    remove_path,
)
from lightning_parallel.checkpoint.sharded import read_whole, reading
from lightning_parallel.checkpoint.unpickling import checked_unpickling

#: How a refusal to unpickle a checkpoint being resumed names the opt-in.
RESUME_OPT_IN = "weights_only=False to trainer.fit (or validate/test/predict; in recipes/train.py: +trust_pickle=true)"


class ParallelCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint file only under a temporary name and renames it when complete; reads both formats.

    A sharded checkpoint (a directory) is read whole in this one process: tensors assembled from every
    rank's shards, optimizer state keyed by parameter names in the optimizer's order (which
    ``Optimizer.load_state_dict`` maps by position).

    Checkpoints record how many data-parallel replicas wrote them, so that a checkpoint taken mid-epoch
    resumes at the same global sample under another number of replicas (see ``data_position.py``).

    Args:
        data_parallel_size: Replicas of the run that loads; ``None``: the world size (Lightning's own
            strategies are data parallel only). lightning_parallel's strategies set it.
    """

    def __init__(self, data_parallel_size: int | None = None) -> None:
        super().__init__()
        self.data_parallel_size = data_parallel_size

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint does not take storage_options (got {storage_options!r}); "
                "remove the argument."
            )
        if INFO_KEY not in checkpoint:  # written by one of Lightning's own (data-parallel) strategies
            world_size = _world_size()
            checkpoint = {**checkpoint, INFO_KEY: {"format": "full", "layout": {"pp": 1, "dp": world_size, "tp": 1}, "world_size": world_size}}
        atomic_torch_save(checkpoint, path)

    @override
    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        trust = weights_only is False
        if checkpoint_format(path) == "sharded":
            checkpoint = read_whole(path, weights_only, RESUME_OPT_IN)
        else:
            # Lightning's own default for a remote path is a full unpickle: None means weights-only here.
            with reading(path), checked_unpickling(path, trust_pickle=trust, opt_in=RESUME_OPT_IN):
                if map_location is None:
                    checkpoint = super().load_checkpoint(path, weights_only=not trust)
                else:
                    checkpoint = super().load_checkpoint(path, map_location=map_location, weights_only=not trust)
        rescale_loader_positions(checkpoint, self.data_parallel_size or _world_size())
        return checkpoint

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        remove_path(path)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
