"""Every benchmark ``make benchmark`` runs, in its smoke mode (tiny model, one round), in one go.

    python benchmarks/smoke.py [--out DIR] [--only NAME ...]   # writes only under DIR (default: a temporary one)

About 1.5 min on 2 busy cores without ``planner_accuracy`` (six fresh recipe processes: minutes on its own).

Each script's ``--smoke`` runs what the full run runs (its workers, its summary, its report) on a tiny model for
one round, the report going to ``--results DIR`` (the committed results are never touched). What makes a smoke run
slow on 2 cores is starting processes (each imports torch, Lightning and transformers), so here the scripts' mains
run in this process, one after another, and their worker runs do not start processes of their own: a 2-rank run
goes to one torchrun launch of 2 ranks started once (:class:`WorkerPool`; each run is its own Trainer, as the
test suite's shared launches run their jobs), a one-process run runs in this process.
``tests/distributed/test_benchmarks_smoke.py`` runs this in the suite, so a change that breaks a benchmark fails CI.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `benchmarks.*` importable

from benchmarks import common

REPO_ROOT = common.REPO_ROOT
#: The scripts ``make benchmark`` runs whose smoke mode runs here (``hot_path.py``'s jobs are the suite's shared
#: 4-rank launch: ``tests/distributed/test_benchmarks_smoke.py`` writes its report from that launch, and
#: ``python benchmarks/hot_path.py --smoke`` runs its 2-block jobs by hand).
SCRIPTS = (
    "dp_vs_ddp", "tp_vs_model_parallel", "tp_vs_hf_tp", "expert_parallel", "pp_efficiency", "hybrid_layouts",
    "checkpoint_io", "planner_accuracy", "sync_stragglers", "context_parallel",
)
#: What training leaves in ``os.environ`` (Lightning's launcher, ``seed_everything``): restored after a run here.
_LEFT_BY_TRAINING = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK", "PL_GLOBAL_SEED",
                     "PL_SEED_WORKERS", "OMP_NUM_THREADS")


def run_in_this_process(script: Path, argv: list[str], pool_rank: bool = False) -> None:
    """``script``'s ``main(argv)`` here, leaving this process's threads and environment as they were.

    In the smoke run's own process, a process group the run left is destroyed too; a ``pool_rank`` keeps its world
    of 2 for its next run (torchrun's store would not let it join again).
    """
    import torch
    import torch.distributed as dist

    threads, environ, had_group = torch.get_num_threads(), dict(os.environ), dist.is_initialized()
    try:
        importlib.import_module(f"benchmarks.{script.stem}").main(argv)
    finally:
        torch.set_num_threads(threads)
        # A one-device Trainer under a parallel strategy leaves its world of one (Lightning never destroys the
        # process group it made): the next run here, or a test after this one, could not start its own.
        if dist.is_initialized() and not had_group and not pool_rank:
            dist.destroy_process_group()
        for name in _LEFT_BY_TRAINING:
            if name in environ:
                os.environ[name] = environ[name]
            else:
                os.environ.pop(name, None)


class WorkerPool:
    """Two ranks started once (torchrun) that run the benchmarks' 2-rank worker runs one after another.

    A run is a file ``<folder>/<n>.json`` (``{"script", "argv"}``); each rank runs the script's ``main(argv)`` and
    leaves ``<n>.rank<r>.ok``, or ``<n>.rank<r>.err`` with the traceback and exits (the pool is then started again
    for the next run). One-process runs (``ranks=1``) run in this process.
    """

    def __init__(self, folder: Path, timeout: float = 300.0) -> None:
        self.folder, self.timeout = folder, timeout
        self.proc: subprocess.Popen | None = None
        self.count = 0

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.count = 0
        for stale in self.folder.glob("*"):
            stale.unlink()
        env = {k: v for k, v in os.environ.items() if k not in _LEFT_BY_TRAINING}
        env["OMP_NUM_THREADS"] = "1"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   str(Path(__file__)), "--serve", str(self.folder), "--client", str(os.getpid())]
        with (self.folder / "pool.log").open("w") as log:
            self.proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def run(self, script: Path, argv: list[str], ranks: int) -> None:
        if ranks == 1:
            run_in_this_process(script, argv)
            return
        if ranks != 2:
            raise ValueError(f"the smoke pool runs 1- or 2-rank runs; {script.name} {' '.join(argv)} asks for {ranks}")
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        job = self.folder / f"{self.count}.json"
        self.count += 1
        written = job.with_suffix(".tmp")
        written.write_text(json.dumps({"script": str(script), "argv": argv}))
        written.rename(job)  # whole, or not there: the ranks never read half a file
        deadline = time.monotonic() + self.timeout
        while not all(job.with_suffix(f".rank{r}.ok").exists() for r in range(2)):
            errors = [path.read_text() for path in sorted(self.folder.glob(f"{job.stem}.rank*.err"))]
            ended = self.proc.poll() is not None
            if errors or ended or time.monotonic() > deadline:
                self.close()
                why = errors[0] if errors else ("the pool ended" if ended else f"no answer in {self.timeout:.0f} s")
                log = (self.folder / "pool.log").read_text()[-3000:] if (self.folder / "pool.log").exists() else ""
                raise RuntimeError(f"{script.name} {' '.join(argv)} failed in the smoke pool: {why}\n{log}")
            time.sleep(0.05)

    def close(self) -> None:
        if self.proc is None:
            return
        (self.folder / "stop").touch()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc.returncode not in (0, None):  # a rank that failed: the other may wait in a collective
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def serve(folder: Path, client: int) -> None:
    """A rank of the :class:`WorkerPool`: run the runs in ``folder`` in order until ``stop`` appears, or the client
    process (pid ``client``) is gone (killed at a test's timeout: its ranks must not wait for runs forever)."""
    rank, count = int(os.environ["RANK"]), 0
    while True:
        job = folder / f"{count}.json"
        while not job.exists():
            if (folder / "stop").exists() or not _alive(client):
                import torch.distributed as dist

                if dist.is_initialized():  # close gloo's threads before the interpreter goes
                    dist.destroy_process_group()
                return
            time.sleep(0.05)
        spec = json.loads(job.read_text())
        try:
            run_in_this_process(Path(spec["script"]), spec["argv"], pool_rank=True)
        except BaseException:
            job.with_suffix(f".rank{rank}.err").write_text(traceback.format_exc())
            raise
        job.with_suffix(f".rank{rank}.ok").touch()
        count += 1


def run_smokes(out: Path, names: list[str]) -> dict[str, str | None]:
    """Each script's ``main(["--smoke", "--results", out/<name>])``; by name, None or why it failed."""
    failures: dict[str, str | None] = {}
    pool = WorkerPool(Path(tempfile.mkdtemp(prefix="benchmark-pool-")))
    common.set_worker_pool(pool)
    try:
        for name in names:
            start = time.perf_counter()
            try:
                run_in_this_process(REPO_ROOT / "benchmarks" / f"{name}.py", ["--smoke", "--results", str(out / name)])
                failures[name] = None
            except Exception as error:  # noqa: BLE001 - every script runs; the report names each failure
                failures[name] = f"{type(error).__name__}: {error}"
            print(f"{name}: {'ok' if failures[name] is None else 'FAILED'} in {time.perf_counter() - start:.1f} s",
                  file=sys.stderr, flush=True)
    finally:
        common.set_worker_pool(None)
        pool.close()
        shutil.rmtree(pool.folder, ignore_errors=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="where the smoke reports go (default: a temporary folder)")
    parser.add_argument("--only", nargs="+", choices=SCRIPTS, default=list(SCRIPTS))
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.client)
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="benchmark-smoke-"))
    failures = run_smokes(out, args.only)
    for name, why in failures.items():
        if why:
            print(f"{name}: {why}", file=sys.stderr)
    print(f"reports under {out}")
    return 1 if any(failures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
