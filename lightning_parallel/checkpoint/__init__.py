"""Checkpoints that move between layouts.

- ``files``: where checkpoints live, atomic publication, finding the latest complete one.
- ``sharded``: each rank writes its shards through ``torch.distributed.checkpoint``; any layout reads them.
- ``state``: whole-tensor state of split and staged modules (the ``full`` format, one ``torch.save`` file).
- ``io``: a Lightning ``CheckpointIO`` that lets Lightning's own strategies read sharded checkpoints.
- ``export``: a Hugging Face model directory (safetensors, config.json) from either format, in one process.
- ``python -m lightning_parallel.checkpoint inspect|convert|export``: what a checkpoint holds; sharded ↔ full; to Hugging Face.
"""

from lightning_parallel.checkpoint.files import (
    CheckpointFormat,
    atomic_torch_save,
    checkpoint_format,
    is_complete,
    latest_checkpoint,
    remove_path,
)
from lightning_parallel.checkpoint.sharded import read_whole
from lightning_parallel.checkpoint.state import (
    copy_whole_into,
    describe_mismatch,
    full_model_state,
    full_optimizer_state,
    gather_pipeline_parts,
    is_named_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    load_into_stages,
    local_named_optimizer_state,
    named_optimizer_state,
)

__all__ = [
    "CheckpointFormat",
    "atomic_torch_save",
    "checkpoint_format",
    "copy_whole_into",
    "describe_mismatch",
    "full_model_state",
    "full_optimizer_state",
    "gather_pipeline_parts",
    "is_complete",
    "is_named_optimizer_state",
    "latest_checkpoint",
    "load_full_model_state",
    "load_full_optimizer_state",
    "load_into_stages",
    "local_named_optimizer_state",
    "named_optimizer_state",
    "read_whole",
    "remove_path",
]
