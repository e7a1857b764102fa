"""Process launch: Lightning's launchers, with the Hydra multirun case fixed.

Lightning re-runs the user's script once per extra local rank ("popen"). Under Hydra it rebuilds the
child command from ``sys.argv``; in a multirun (``-m``) that would make every child run the *whole sweep*.
We rebuild it from the current job's own overrides and point the child at the job's output directory,
so single runs and sweeps behave the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.strategies.launchers import (
    _MultiProcessingLauncher,
    _SubprocessScriptLauncher,
)
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from typing_extensions import override

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS: tuple[str, ...] = ("popen", "spawn", "fork", "forkserver")


def make_launcher(strategy: Any, start_method: StartMethod, environment: ClusterEnvironment) -> _Launcher:
    """The launcher for ``start_method``; external launchers (torchrun, SLURM) need none of ours.

    With ``popen`` and an environment that creates processes externally, Lightning's launcher only
    validates the settings and runs the function in place, which is what torchrun/SLURM need.
    """
    if start_method == "popen":
        return HydraAwareSubprocessLauncher(environment, strategy.num_processes, strategy.num_nodes)
    return _MultiProcessingLauncher(strategy, start_method=start_method)


class HydraAwareSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess-script launcher whose children re-run only the current Hydra job."""

    @override
    def _call_children_scripts(self) -> None:
        if not _hydra_job_running():
            super()._call_children_scripts()
            return
        self._check_can_spawn_children()
        self.procs = []
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = f"{self.num_processes * self.num_nodes}"
        for local_rank in range(1, self.num_processes):
            env = os.environ.copy()
            env["LOCAL_RANK"] = str(local_rank)
            if os.environ.get("PL_GLOBAL_SEED") is None:
                env.pop("PL_GLOBAL_SEED", None)
            command, cwd = hydra_job_command(local_rank)
            self.procs.append(subprocess.Popen(command, env=env, cwd=cwd))


def _hydra_job_running() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return False
    return HydraConfig.initialized()


def hydra_job_command(local_rank: int) -> tuple[Sequence[str], str]:
    """Command and working directory that re-run the current Hydra job (not the sweep) as ``local_rank``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    config = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += _config_selection_flags(sys.argv[1:])
    # The job's own overrides: in a multirun these hold this job's values, not the sweep syntax.
    command += list(config.overrides.task)
    command += [
        f'hydra.run.dir="{config.runtime.output_dir}"',
        f"hydra.job.name={config.job.name}_rank{local_rank}",
        # Only rank 0 writes the composed config; children would race on the same files.
        "hydra.output_subdir=null",
    ]
    return command, get_original_cwd()


_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def _config_selection_flags(argv: Sequence[str]) -> list[str]:
    """The flags that choose which config Hydra composes (``--config-name x`` or ``--config-name=x``)."""
    flags: list[str] = []
    for index, arg in enumerate(argv):
        if arg in _CONFIG_FLAGS and index + 1 < len(argv):
            flags += [arg, argv[index + 1]]
        elif arg.split("=", 1)[0] in _CONFIG_FLAGS and "=" in arg:
            flags.append(arg)
    return flags


# What Lightning's launcher writes into the launching process's environment. OMP_NUM_THREADS it sets (with
# torch.set_num_threads) to cores // ranks of *this* job when absent, and never again once present: kept, a second
# job of more ranks would run each of them on the first job's thread count, and the processes it starts (torchrun
# gives a rank one thread only when the variable is absent) would inherit it too.
_LAUNCH_ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS")


@contextmanager
def training_job() -> Iterator[None]:
    """Scope one training job so that the next one in the same process starts clean.

    Lightning's launcher leaves ``LOCAL_RANK``/``MASTER_PORT``/... in ``os.environ`` and the default process
    group alive. A second job in the same interpreter (a Hydra ``-m`` sweep, a notebook) would then think
    its ranks were already launched and wait for peers that never come. It also leaves its ``OMP_NUM_THREADS``
    and torch's thread count, chosen for the first job's number of ranks. On exit this destroys the process
    group the job created and restores those variables and the thread count.
    """
    saved = {name: os.environ.get(name) for name in _LAUNCH_ENV_VARS}
    threads = torch.get_num_threads()
    had_process_group = dist.is_available() and dist.is_initialized()
    try:
        yield
    finally:
        if not had_process_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        torch.set_num_threads(threads)


def as_timedelta(timeout: float | timedelta) -> timedelta:
    """A process-group timeout from seconds or a ``timedelta`` (positive)."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds (a number) or a datetime.timedelta, got {type(timeout).__name__}.")
    if seconds <= 0:
        raise ValueError(f"timeout={seconds}s must be positive: it is how long a collective may wait before failing.")
    return timedelta(seconds=seconds)


def restart_attempt() -> int:
    """Which restart of the job this process belongs to (0: the first run; torchrun and SLURM requeues count)."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def elastic_restart_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """The store for the default process group under torchrun, one namespace per restart attempt.

    torchrun hands its workers the rendezvous' own TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``), which
    outlives a restart; torch (2.13, checked) connects to it without a per-attempt prefix ("we create a new
    TCPStore for every retry"), so a restarted worker reads the addresses the killed attempt published —
    gloo fails with "connectFullMesh ... Connection refused", NCCL hangs. Everything of this attempt goes
    under its own prefix instead. ``None`` outside torchrun's agent store (the default rendezvous is fine).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"/lightning_parallel/attempt_{restart_attempt()}", store)
