"""One simulated rank of a layout: the real strategy, one training step, on torch's ``fake`` process group.

``python -m lightning_parallel.dry_run --rank R [--config-dir conf] [--json OUT] [Hydra overrides]`` builds what
``recipes/train.py`` builds from the same config — data, strategy, Trainer, model (always on the meta device, so
the rank materialises only what it holds) — and trains one optimizer step as rank ``R`` of
``trainer.devices × trainer.num_nodes`` ranks. The fake backend's collectives move nothing but check shapes, so
mesh, plan, pipeline split, sharding, placement and the step all run as on the cluster; the values are
meaningless. Decisions rank 0 would broadcast are taken by the simulated rank itself (the same, deterministic).
The planner's ``--simulate`` (:mod:`lightning_parallel.plan.simulate`) runs this once per chosen rank, in a
process of its own, and sets the figures beside its predictions.

Reported (JSON): the rank's coordinates, the bytes of its real shards (parameters, gradients, optimizer state),
the bytes it handed to collectives in the step by axis (data-parallel gradient reduction, tensor- and
context-parallel DTensor collectives, pipeline sends), the pipeline schedule's actions on this rank, the
seconds setup and the step took, and the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_parallel.measure.memory import state_bytes
from lightning_parallel.observe.monitor import ScalingMonitor
from lightning_parallel.parallelize.placement.deferred_init import starting_values_skipped
from lightning_parallel.strategies import ParallelEngineStrategy


@contextmanager
def fake_world(rank: int, world_size: int, ranks_per_node: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` on the fake backend, as torchrun would describe it.

    Object collectives return this rank's own object (the fake backend cannot move pickles), and the
    environment torchrun sets makes Lightning take the ranks as launched (it starts no process).
    """
    env = {
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % ranks_per_node),
        "LOCAL_WORLD_SIZE": str(ranks_per_node), "GROUP_RANK": str(rank // ranks_per_node),
        "NODE_RANK": str(rank // ranks_per_node), "MASTER_ADDR": "localhost", "MASTER_PORT": "1",
        "TORCHELASTIC_RUN_ID": "lightning_parallel-dry-run",
    }
    saved_env = {key: os.environ.get(key) for key in env}
    saved = {name: getattr(dist, name) for name in ("broadcast_object_list", "all_gather_object", "gather_object")}
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    # DDP's default hook reads its all-reduce's result, which the fake backend's work does not carry: hand the bucket
    # back as reduced (values are meaningless here). Private torch API, checked against torch 2.13.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    saved_reduce = default_hooks._allreduce_fut
    default_hooks._allreduce_fut = _bucket_as_reduced
    os.environ.update(env)
    dist.broadcast_object_list = lambda objects, *args, **kwargs: None  # each entry stays this rank's
    dist.all_gather_object = lambda out, obj, *args, **kwargs: out.__setitem__(slice(None), [obj] * len(out))
    dist.gather_object = lambda obj, out=None, *args, **kwargs: out.__setitem__(slice(None), [obj] * len(out)) if out else None
    # A store that holds keys (the progress watchdog writes where each rank is); the fake one does not.
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        default_hooks._allreduce_fut = saved_reduce
        for name, function in saved.items():
            setattr(dist, name, function)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _bucket_as_reduced(process_group: Any, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


@contextmanager
def counted_pipeline_sends() -> Iterator[dict[str, int]]:
    """Bytes and count of the point-to-point sends and receives torch's pipeline schedules issue."""
    from torch.distributed.pipelining import schedules

    tally = {"bytes": 0, "sends": 0, "receives": 0}
    # Private torch API (checked against torch 2.13): every schedule's transfers go through _batch_p2p.
    original = schedules._batch_p2p

    def counting(ops: list[dist.P2POp], desc: str | None = None) -> Any:
        for op in ops:
            if op.op is dist.isend:
                tally["bytes"] += op.tensor.numel() * op.tensor.element_size()
                tally["sends"] += 1
            else:
                tally["receives"] += 1
        return original(ops, desc)

    schedules._batch_p2p = counting
    try:
        yield tally
    finally:
        schedules._batch_p2p = original


class _SetupClock(L.Callback):
    """Seconds from building the Trainer to the first training batch (mesh, plan, sharding, placement)."""

    def __init__(self, start: float) -> None:
        self.start, self.setup_s = start, 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.setup_s:
            self.setup_s = time.perf_counter() - self.start


def simulate_rank(cfg: Any, rank: int) -> dict[str, Any]:
    """Train one step as rank ``rank`` of the configured world on the fake backend; the figures of that rank."""
    from hydra.utils import instantiate

    devices, nodes = int(cfg.trainer.devices), int(cfg.trainer.get("num_nodes", 1))
    world = devices * nodes
    if not 0 <= rank < world:
        raise ValueError(f"--rank {rank} is outside the {world} ranks of trainer.devices={devices} × trainer.num_nodes={nodes}.")
    start = time.perf_counter()
    # Values are meaningless on the fake backend: skip replaying the model's construction for starting values.
    with fake_world(rank, world, devices), counted_pipeline_sends() as sends, starting_values_skipped():
        L.seed_everything(cfg.seed, verbose=False)
        datamodule = instantiate(cfg.data)
        strategy = instantiate(cfg.strategy)
        if not isinstance(strategy, ParallelEngineStrategy):
            raise TypeError(f"A dry run needs one of lightning_parallel's strategies; strategy={type(strategy).__name__}.")
        monitor, clock = ScalingMonitor(warmup_steps=0), _SetupClock(start)
        trainer = instantiate(
            cfg.trainer, strategy=strategy, max_steps=1, logger=False, callbacks=[monitor, clock], enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        )
        with trainer.init_module(empty_init=True):
            model = instantiate(cfg.model)
        trainer.fit(model, datamodule=datamodule)
        step = monitor.steps[-1] if monitor.steps else None
        held = state_bytes(trainer.lightning_module, trainer.optimizers)
        actions = _schedule_actions(monitor)
        coordinates = strategy.layout.axis_coordinates(rank)
        layout = strategy.layout.describe()
    return {
        "rank": rank,
        "world_size": world,
        "layout": layout,
        "coordinates": coordinates,
        "state_bytes": held.as_dict(),
        "comm_bytes": {
            "dp": step.dp_bytes if step else 0, "tp": step.tp_bytes if step else 0,
            "cp": step.cp_bytes if step else 0, "pp": sends["bytes"],
        },
        "pipeline": {"sends": sends["sends"], "receives": sends["receives"], "actions": actions},
        "setup_s": clock.setup_s,
        "total_s": time.perf_counter() - start,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _schedule_actions(monitor: ScalingMonitor) -> dict[str, int]:
    """How many actions of each kind (F forward, B backward, W weight gradient) this rank's stages ran in the step."""
    counts: dict[str, int] = {}
    for event in monitor._pipeline.events:
        counts[event.kind] = counts.get(event.kind, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_parallel.dry_run", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for recipes/train.py")
    parser.add_argument("--rank", type=int, required=True, help="the global rank to simulate")
    parser.add_argument("--config-dir", default="conf", help="Hydra config directory (default: ./conf)")
    parser.add_argument("--config-name", default="config", help="primary config (default: config)")
    parser.add_argument("--json", metavar="PATH", help="write the figures here (default: print them)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from hydra import compose, initialize_config_dir

    torch.set_num_threads(1)
    import tempfile

    output = tempfile.mkdtemp(prefix="lightning_parallel-dry-run-")  # no Hydra run dir outside recipes/train.py
    with initialize_config_dir(config_dir=str(Path(args.config_dir).resolve()), version_base="1.3"):
        cfg = compose(config_name=args.config_name, overrides=[*args.overrides, f"paths.output_dir={output}"])
    figures = simulate_rank(cfg, args.rank)
    text = json.dumps(figures, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
