"""Several test jobs in one set of processes: ``python -m tests.jobs_worker PLAN.json`` under torchrun.

Starting processes is the slow part of a small job on 2 cores; jobs with the same number of ranks can
share them (each job is its own Trainer and strategy). The plan lists ``{"spec": JobSpec fields, "result":
path}``; each job's rank 0 saves its findings there (a checkpoint round trip writes beside it).
"""

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from tests.harness import JobSpec, run_job

if __name__ == "__main__":
    for job in json.loads(Path(sys.argv[1]).read_text()):
        start = time.perf_counter()
        run_job(JobSpec(**job["spec"]), save_path=Path(job["result"]))
        if not dist.is_initialized() or dist.get_rank() == 0:
            # Which jobs make a launch slow (the suite's time budget is shared by every launch).
            print(f"job {Path(job['result']).parent.name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if dist.is_initialized():
        # Leave together and close the process group before the interpreter exits: a rank that exits while
        # gloo's threads still run can abort ("terminate called without an active exception", seen once in CI).
        dist.barrier()
        dist.destroy_process_group()
