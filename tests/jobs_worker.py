"""Several test jobs in one set of processes: ``python -m tests.jobs_worker PLAN.json`` under torchrun.

Starting processes is the slow part of a small job on 2 cores; jobs with the same number of ranks can
share them (each job is its own Trainer and strategy). The plan lists ``{"spec": JobSpec fields, "result":
path}``; each job's rank 0 saves its findings there (a checkpoint round trip writes beside it).

A job the library must refuse (``JobSpec.expect_refusal``) runs after the others: its error is saved as the job's
result (``{"refused": {"error", "message"}}``) on rank 0, and the ranks meet at a barrier before the next one
(a refusal raised on every rank alike, before any collective, leaves the process group usable).
"""

import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.harness import JobSpec, run_job


def run_refused(spec: JobSpec, result: Path) -> None:
    """Run a job expected to be refused; rank 0 saves what happened (the error, or nothing refused)."""
    try:
        run_job(spec, save_path=result)
    except Exception as error:  # noqa: BLE001 - the error is the finding
        if not dist.is_initialized() or dist.get_rank() == 0:
            torch.save({"refused": {"error": type(error).__name__, "message": str(error)}}, result)
    if dist.is_initialized():
        dist.barrier()


def _threads() -> int:
    return sum(1 for _ in Path("/proc/self/task").iterdir())


def destroy_job_groups() -> None:
    """Destroy every process group but the default one, once the job that made them is over.

    Each job's device mesh makes subgroups of its own, and each gloo group keeps its transport threads until the
    group is destroyed. Left alive, a launch of 60 jobs held ~1,400 threads per rank whose polling loops took the
    whole machine (load average in the hundreds). With this, the 66-job launch ends at ~800 threads per rank
    (groups of some pipeline jobs stay alive in torch after their destruction: not found why) in 12 min on quiet cores.
    """
    if not dist.is_initialized():
        return
    gc.collect()  # the job's trainer, strategy and mesh: nothing of the job may keep using its groups
    dist.barrier()
    default = dist.distributed_c10d._get_default_group()
    for group in [group for group in dist.distributed_c10d._world.pg_map if group is not default]:
        dist.destroy_process_group(group)
    # A device mesh equals any other of the same layout, so what DTensor and compiled code cached for this job's
    # mesh would serve the next job's equal one with the destroyed groups ("could not resolve the process group").
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()
    torch._dynamo.reset()


if __name__ == "__main__":
    plan = json.loads(Path(sys.argv[1]).read_text())
    for job in sorted(plan, key=lambda job: bool(job["spec"].get("expect_refusal"))):  # refusals last (stable)
        start = time.perf_counter()
        spec, result = JobSpec(**job["spec"]), Path(job["result"])
        if spec.expect_refusal:
            run_refused(spec, result)
        else:
            run_job(spec, save_path=result)
        destroy_job_groups()
        if not dist.is_initialized() or dist.get_rank() == 0:
            # Which jobs make a launch slow (the suite's time budget is shared by every launch), and the threads
            # the rank holds after it (they grow when a job's groups outlive it).
            print(f"job {result.parent.name}: {time.perf_counter() - start:.1f} s, {_threads()} threads", file=sys.stderr)
    if dist.is_initialized():
        # Leave together and close the process group before the interpreter exits: a rank that exits while
        # gloo's threads still run can abort ("terminate called without an active exception", seen once in CI).
        dist.barrier()
        dist.destroy_process_group()
