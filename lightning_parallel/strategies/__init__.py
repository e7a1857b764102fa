"""Lightning strategies; importing this package registers their names with Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_parallel.strategies.auto import AutoParallelStrategy
from lightning_parallel.strategies.data import DataParallelStrategy
from lightning_parallel.strategies.engine import ParallelEngineStrategy
from lightning_parallel.strategies.hybrid import HybridParallelStrategy
from lightning_parallel.strategies.pipeline import PipelineParallelStrategy
from lightning_parallel.strategies.tensor import TensorParallelStrategy


def _register() -> None:
    for suffix, start_method, when in (
        ("", "popen", "re-runs the script per rank; for scripts, Hydra, torchrun and SLURM"),
        ("_spawn", "spawn", "spawns workers; for notebooks and tests"),
        ("_fork", "fork", "forks workers; for notebooks on Linux/macOS"),
    ):
        DataParallelStrategy.register_as(
            StrategyRegistry,
            f"data_parallel{suffix}",
            description=f"lightning_parallel data parallelism (DDP, exact accumulation), start_method={start_method!r}: {when}",
            start_method=start_method,
        )
        TensorParallelStrategy.register_as(
            StrategyRegistry,
            f"tensor_parallel{suffix}",
            description=f"lightning_parallel tensor parallelism (automatic Megatron-style plan), start_method={start_method!r}: {when}",
            start_method=start_method,
        )
        HybridParallelStrategy.register_as(
            StrategyRegistry,
            f"hybrid_parallel{suffix}",
            description=f"lightning_parallel dp × tp × pp on one DeviceMesh, start_method={start_method!r}: {when}",
            start_method=start_method,
        )
        PipelineParallelStrategy.register_as(
            StrategyRegistry,
            f"pipeline_parallel{suffix}",
            description=f"lightning_parallel pipeline parallelism (traced split, torch schedules), start_method={start_method!r}: {when}",
            start_method=start_method,
        )


_register()

__all__ = ["AutoParallelStrategy", "DataParallelStrategy", "HybridParallelStrategy", "ParallelEngineStrategy", "PipelineParallelStrategy", "TensorParallelStrategy"]
