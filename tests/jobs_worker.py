"""Several test jobs in one set of processes: ``python -m tests.jobs_worker PLAN.json`` under torchrun.

Starting processes is the slow part of a small job on 2 cores; jobs with the same number of ranks can
share them (each job is its own Trainer and strategy). The plan lists ``{"spec": JobSpec fields, "result":
path}``; each job's rank 0 saves its findings there (a checkpoint round trip writes beside it).

A job the library must refuse (``JobSpec.expect_refusal``) runs after the others: its error is saved as the job's
result (``{"refused": {"error", "message"}}``) on rank 0, and the ranks meet at a barrier before the next one
(a refusal raised on every rank alike, before any collective, leaves the process group usable).
"""

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


if __name__ == "__main__":
    plan = json.loads(Path(sys.argv[1]).read_text())
    for job in sorted(plan, key=lambda job: bool(job["spec"].get("expect_refusal"))):  # refusals last (stable)
        start = time.perf_counter()
        spec, result = JobSpec(**job["spec"]), Path(job["result"])
        if spec.expect_refusal:
            run_refused(spec, result)
        else:
            run_job(spec, save_path=result)
        if not dist.is_initialized() or dist.get_rank() == 0:
            # Which jobs make a launch slow (the suite's time budget is shared by every launch).
            print(f"job {result.parent.name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if dist.is_initialized():
        # Leave together and close the process group before the interpreter exits: a rank that exits while
        # gloo's threads still run can abort ("terminate called without an active exception", seen once in CI).
        dist.barrier()
        dist.destroy_process_group()
